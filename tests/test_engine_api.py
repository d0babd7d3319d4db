"""npud/engine/api.py: the request types validate where they are declared, and both the engine and
the daemon tests' fake engine implement the protocols the daemon calls, member for member."""

from __future__ import annotations

import inspect

import pytest

import test_npud_support as fakes
from npud.engine import api, loader
from npud.engine.session import LoadedModel, ModelSession


def _members(protocol: type) -> dict[str, object]:
    """A protocol's own members: methods, properties and annotated attributes."""
    own = {k: v for k, v in vars(protocol).items() if not k.startswith("_")}
    own.update({k: None for k in getattr(protocol, "__annotations__", {})})
    return own


def _parameters(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("protocol, implementations", [
    (api.ServedModel, (LoadedModel, fakes.FakeServedModel)),
    (api.Session, (ModelSession, fakes.FakeSession)),
])
def test_the_engine_and_the_fake_implement_the_protocols(protocol, implementations):
    for cls in implementations:
        for name, member in _members(protocol).items():
            if member is None:  # an attribute: set in __init__, so look at an instance's class or __init__
                assert name in inspect.getsource(cls.__init__) or hasattr(cls, name), (cls, name)
                continue
            assert hasattr(cls, name), (cls, name)
            mine = getattr(cls, name)
            if isinstance(member, property):
                assert isinstance(mine, property), (cls, name, "must be a property")
            else:
                assert _parameters(mine) == _parameters(member), (cls, name)


def test_the_loaders_take_what_the_daemon_passes():
    expected = _parameters(api.ModelLoader.__call__)
    assert _parameters(loader.load_model) == expected
    assert [p[:2] for p in _parameters(fakes.load_model)] == [p[:2] for p in expected]
    assert _parameters(LoadedModel.load)[:2] == expected[:2]


@pytest.mark.parametrize("make, field", [
    (lambda: api.SamplingParams(temperature=-1.0), "temperature"),
    (lambda: api.SamplingParams(top_k=True), "top_k"),
    (lambda: api.SamplingParams(top_p=0.0), "top_p"),
    (lambda: api.SamplingParams(seed=-1), "seed"),
    (lambda: api.SpecParams(method="magic"), "method"),
    (lambda: api.SpecParams(k=0), "SpecParams.k"),
    (lambda: api.SpecParams(adapt_k=1), "adapt_k"),
    (lambda: api.SpecParams(fallback_rounds=-1), "fallback_rounds"),
    (lambda: api.SpecParams(reprobe_after=0), "reprobe_after"),
    (lambda: api.GenerationParams(max_tokens=0), "max_tokens"),
    (lambda: api.GenerationParams(stop=["x"]), "stop"),
    (lambda: api.GenerationParams(stop=("",)), "stop"),
    (lambda: api.GenerationParams(use_prefix_cache="yes"), "use_prefix_cache"),
    (lambda: api.GenerateRequest(), "exactly one"),
    (lambda: api.GenerateRequest(prompt=1), "prompt"),
    (lambda: api.GenerateRequest(messages=[{"role": "user", "content": "x"}]), "messages"),
])
def test_bad_values_are_config_errors_naming_the_field(make, field):
    with pytest.raises(api.ConfigError, match=field) as info:
        make()
    assert info.value.code == api.EngineCode.BAD_REQUEST


def test_errors_carry_their_codes():
    assert api.PromptTooLong("x").code == "prompt_too_long" and isinstance(api.PromptTooLong("x"), api.RequestError)
    assert api.ModelError("x").code == "model_error" and api.NotFound("x").code == "not_found"
    assert api.EngineError("x", api.EngineCode.NOT_FOUND).code == "not_found"
    assert all(issubclass(e, ValueError) for e in (api.EngineError, api.ConfigError, api.ModelError))


def test_one_default_k():
    # k None: the method's default, resolved by the loop (prompt lookup's, else DEFAULT_SPEC_K)
    assert api.SpecParams().k is None is api.GenerationParams().spec.k
    assert api.DEFAULT_LOOKUP_K > api.DEFAULT_SPEC_K
    assert api.SpecParams().method == api.DEFAULT_SPEC_METHOD in api.SPEC_METHODS
