"""The assistant served as spec method "assistant": the session API, npud's per-model
`assistant_dir`, the job spec and npuctl (there is no HTTP front end yet)."""

from __future__ import annotations

import pytest

from assistant_fixtures import build_assistant, build_base
from npud.clients.npuctl import build_parser
from npud.engine.assistant import AssistantMismatchError
from npud.engine.api import EngineCode, GenerateRequest, GenerationParams, RequestError, SamplingParams, SpecParams
from npud.engine.session import LoadedModel
from npud.config import LimitsConfig, check_models, load_config
from npud.jobspec import parse_spec
from npud.protocol import Params

PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    return {"base": build_base(root / "base"), "assistant": build_assistant(root / "assistant", seed=7, ordered=True),
            "wide": build_assistant(root / "wide", seed=8, backbone=48)}


@pytest.fixture(scope="module")
def served(dirs):
    return LoadedModel.load("g", dirs["base"], weight_format="fp32", assistant_dir=dirs["assistant"])


def _run(served, method, k=4, cache=False, prompt=PROMPT):
    params = GenerationParams(max_tokens=24, use_prefix_cache=cache, spec=SpecParams(method=method, k=k, fallback_rounds=0))
    session = served.start(GenerateRequest(prompt=prompt, params=params))
    while not session.done:
        session.run_round()
    return session.result()


def test_spec_method_assistant_gives_plain_decodes_text(served):
    plain = _run(served, "none")
    for k in (1, 3, 7):
        r = _run(served, "assistant", k=k)
        assert r.token_ids == plain.token_ids and r.text.encode() == plain.text.encode()
        assert r.stats["rounds"] > 0 and r.stats["drafted"] > 0 and not r.stats["fell_back"]
    assert served.describe()["assistant"] is True
    assert served.nbytes > served.model.nbytes


def test_auto_picks_the_assistant_and_a_restored_prefix_keeps_it_drafting(served):
    long = PROMPT * 8  # past a cache block
    first = _run(served, "auto", cache=True, prompt=long)  # fills the prefix cache
    again = _run(served, "auto", cache=True, prompt=long)  # restores it: the planes come back, the head still drafts
    assert again.stats["num_cached_tokens"] > 0
    assert again.token_ids == first.token_ids == _run(served, "none", prompt=long).token_ids
    assert again.stats["drafted"] > 0 and not again.stats["fell_back"]


def test_a_model_without_an_assistant_refuses_the_method(dirs):
    bare = LoadedModel.load("g", dirs["base"], weight_format="fp32")
    with pytest.raises(RequestError) as err:
        _run(bare, "assistant")
    assert err.value.code is EngineCode.BAD_REQUEST and "no assistant drafter" in str(err.value)


def test_an_assistant_for_another_base_does_not_load(dirs):
    with pytest.raises(AssistantMismatchError, match="hidden size 48, this base has 64"):
        LoadedModel.load("g", dirs["base"], weight_format="fp32", assistant_dir=dirs["wide"])


def test_npud_config_reads_assistant_dir(tmp_path):
    (tmp_path / "npud.toml").write_text(
        '[[models]]\nname = "g"\ncheckpoint_dir = "base"\nassistant_dir = "assistant"\n')
    cfg = load_config(tmp_path / "npud.toml")
    assert cfg.models[0].assistant_dir == str(tmp_path / "assistant")
    assert any("assistant_dir" in p and "does not exist" in p for p in check_models(cfg))


def test_job_spec_and_npuctl_accept_the_method():
    p = Params({"prompts": ["x"], "spec": {"method": "assistant", "k": 3}})
    spec = parse_spec(p, limits=LimitsConfig(), models=("g",), default_model="g", single=False)
    assert spec.params.spec.method == "assistant"
    args = build_parser().parse_args(["complete", "--spec", "assistant", "hello"])
    assert args.spec == "assistant"


def test_a_sampled_request_drafts_without_a_head_error(served):
    params = GenerationParams(max_tokens=16, use_prefix_cache=False, sampling=SamplingParams(temperature=0.8, seed=3),
                              spec=SpecParams(method="assistant", k=3, fallback_rounds=0))
    session = served.start(GenerateRequest(prompt=PROMPT, params=params))
    while not session.done:
        session.run_round()
    r = session.result()
    assert len(r.token_ids) == 16 and r.stats["drafted"] > 0 and not r.stats["fell_back"]
