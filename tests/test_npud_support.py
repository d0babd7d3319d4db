"""A fake engine behind npud.engine.api's protocols, for daemon tests that must not depend on model
speed: deterministic tokens, a configurable number of tokens per round and sleep per round.
`load_model` is its npud.engine.api.ModelLoader (daemons in this process get it as `loader`;
daemon processes started by DaemonProc(fake_engine=True) run npud.main with it); its knobs live
in `fake.json` in the model's checkpoint dir. Also the harness that runs real daemon
processes. No tests here.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from pathlib import Path

from npud.engine.api import (
    DEFAULT_PREFILL_BUDGET,
    DeviceFault,
    EngineError,
    FimUnsupported,
    FinishReason,
    GenerateRequest,
    GenerationResult,
    LoadProgress,
    ModelError,
    PromptTooLong,
    RequestError,
    TokenEvent,
)


def prompt_text(req: GenerateRequest) -> str:
    if req.suffix is not None:  # fill-in-the-middle: the words of the files, prefix and suffix
        return "\n".join([*(f"{name}: {text}" for name, text in req.fim_extra), req.prompt, "<fim>", req.suffix])
    if req.prompt is not None:
        return req.prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in req.messages)


def token_id(prompt: str, i: int) -> int:
    """The i-th generated token for a prompt: a pure function, so results can be predicted."""
    return (zlib.crc32(prompt.encode()) + 7 * i) % 1000


def expected_text(prompt: str, max_tokens: int) -> str:
    return "".join(f" w{token_id(prompt, i)}" for i in range(max_tokens))


ROUNDS_LOCK = threading.Lock()
ROUNDS: list[tuple[str, int]] = []  # (prompt, tokens so far) after each round, for in-process tests
BATCHES: list[list[str]] = []  # the prompts of each run_batch call, for in-process tests


class FakeSession:
    """An npud.engine.api.Session: tokens_per_round tokens a round, each " w<id>"."""

    def __init__(self, model: FakeServedModel, req: GenerateRequest) -> None:
        self.model = model
        self.req = req
        self.prompt = prompt_text(req)
        self.ids: list[int] = []
        self.text = ""
        self._cancel = False
        self.finish_reason: FinishReason | None = None
        self.max_tokens = min(req.params.max_tokens, model.max_context - model.count_prompt_tokens(req))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        self._cancel = True

    def run_round(self) -> list[TokenEvent]:
        if self.done:
            raise RuntimeError("run_round on a finished session")
        if self._cancel:
            self.finish_reason = FinishReason.CANCELLED
            return []
        if self.model.round_sleep_s:
            time.sleep(self.model.round_sleep_s)
        fault = self.model.fault_file
        if (fault is not None and Path(fault).exists() and len(self.ids) >= self.model.fault_at_token
                and self.model.fault_prompt in (None, self.prompt)):
            Path(fault).unlink()
            raise DeviceFault("GEMM K=1024 N=3072 on the NPU ended in ERT_CMD_STATE_TIMEOUT (timeout 5000 ms)")
        events = []
        for _ in range(self.model.tokens_per_round):
            tid = token_id(self.prompt, len(self.ids))
            self.ids.append(tid)
            piece = f" w{tid}"
            self.text += piece
            events.append(TokenEvent(tid, piece))
            if any(s in self.text for s in self.req.params.stop):
                self.finish_reason = FinishReason.STOP
                break
            if len(self.ids) >= self.max_tokens:
                self.finish_reason = FinishReason.LENGTH
                break
        with ROUNDS_LOCK:
            ROUNDS.append((self.prompt, len(self.ids)))
        return events

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError("result before the session is done")
        clamped = self.max_tokens if self.max_tokens < self.req.params.max_tokens else None
        stats = {"rounds": len(self.ids), "drafted": 0, "accepted": 0}
        if self.req.messages is not None and self.model.chat_template is not None:
            stats["chat_template"] = self.model.chat_template  # as a real engine names the template of a chat
        return GenerationResult(self.text, tuple(self.ids), self.model.count_prompt_tokens(self.req),
                                self.finish_reason, stats, clamped)


class FakeServedModel:
    """An npud.engine.api.ServedModel without a prefix cache. Knobs from fake.json:
    tokens_per_round, round_sleep_s, max_context, fim (a request with a suffix runs), nbytes,
    round_costs (round_cost(n) is item n - 1, the last for more; absent: None),
    chat_template (the name a chat's stats give its template; None: no such stat),
    fault_file (a round raises
    DeviceFault, as a failed NPU run does, once for each time that file is created;
    fault_prompt and fault_at_token say where)."""

    def __init__(self, name: str, knobs: dict) -> None:
        self.name = name
        self.tokens_per_round = int(knobs.get("tokens_per_round", 1))
        self.round_sleep_s = float(knobs.get("round_sleep_s", 0.0))
        self.max_context = int(knobs.get("max_context", 4096))
        self.fim = bool(knobs.get("fim", False))
        self.nbytes = int(knobs.get("nbytes", 1000))
        self.fault_file = knobs.get("fault_file")
        self.fault_prompt = knobs.get("fault_prompt")  # only the prompt with this text faults (None: any)
        self.fault_at_token = int(knobs.get("fault_at_token", 0))  # after this many of its tokens
        self.chat_template = knobs.get("chat_template")
        self.round_costs = knobs.get("round_costs")  # [cost of a round of n sequences, n = 1, 2, ...]; None: unknown

    def describe(self) -> dict:
        return {"name": self.name, "fake": True, "tokens_per_round": self.tokens_per_round}

    def round_cost(self, sequences: int) -> float | None:
        if self.round_costs is None:
            return None
        return float(self.round_costs[min(sequences, len(self.round_costs)) - 1])

    def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return len(prompt_text(request).split())

    # a vocabulary of the 256 byte values: a token is a byte of the text's UTF-8
    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        return list(text.encode())

    def detokenize(self, ids) -> str:
        if any(not 0 <= i < 256 for i in ids):
            raise RequestError("a token id is outside the vocabulary (size 256)")
        return bytes(ids).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def props(self) -> dict:
        return {"vocab_size": 256, "bos_token": None, "add_bos_token": False, "eos_tokens": [], "chat_template": None,
                "chat_templates": [], "fim_tokens": None}

    def start(self, request: GenerateRequest) -> FakeSession:
        """As the engine: max_tokens clamped to the context, a prompt that fills it refused."""
        if request.suffix is not None and not self.fim:
            raise FimUnsupported("this model has no fill-in-the-middle tokens: its vocabulary lacks <|fim_prefix|>")
        if self.count_prompt_tokens(request) >= self.max_context:
            raise PromptTooLong(f"the prompt has {self.count_prompt_tokens(request)} tokens and the model's context "
                                f"holds {self.max_context}")
        return FakeSession(self, request)

    @property
    def has_prefix_cache(self) -> bool:
        return False

    def cache_info(self) -> dict:
        raise RuntimeError("the fake model has no prefix cache")

    def cache_pin(self, name: str, *, key: str | None = None, text: str | None = None) -> str:
        raise RuntimeError("the fake model has no prefix cache")

    def cache_drop(self, key: str) -> bool:
        raise RuntimeError("the fake model has no prefix cache")

    def cache_flush(self) -> int:
        return 0

    def run_batch(self, sessions, *, prefill_budget: int = DEFAULT_PREFILL_BUDGET):
        """npud.engine.api.ServedModel.run_batch: one round of each session in turn (a round sleeps
        round_sleep_s once for the batch, as a shared weight stream would); an EngineError ends
        only its session's round, DeviceFault voids the round."""
        if len({id(s) for s in sessions}) != len(sessions) or any(s.model is not self or s.done for s in sessions):
            raise ValueError("run_batch takes distinct sessions of this model that are not done")
        with ROUNDS_LOCK:
            BATCHES.append([s.prompt for s in sessions])
        sleep, self.round_sleep_s = self.round_sleep_s, 0.0
        try:
            if sleep:
                time.sleep(sleep)
            out = []
            for session in sessions:
                try:
                    out.append(session.run_round())
                except DeviceFault:
                    raise
                except EngineError as exc:
                    out.append(exc)
            return out
        finally:
            self.round_sleep_s = sleep


def load_model(name: str, checkpoint_dir, *, draft_dir=None, dflash_dir=None, weight_format: str = "bf16",
               cache_dir=None, backend: str = "auto", xrt_design=None, assistant_dir=None,
               xrt_timeout_ms=None, cache_users: int = 7, context_length=None, threads=None,
               chat_template=None, progress=None) -> FakeServedModel:
    """The fake engine's npud.engine.api.ModelLoader: knobs from <checkpoint_dir>/fake.json
    (and load_sleep_s, how long the load takes, told to `progress` as four "weights" steps;
    a context_length caps max_context).

    Raises FileNotFoundError without the file, ModelError when it is not JSON."""
    path = Path(checkpoint_dir) / "fake.json"
    try:
        knobs = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not JSON: {exc}") from None
    sleep = float(knobs.get("load_sleep_s", 0.0))  # a load that takes a while (a cold start)
    for done in range(5):
        if progress is not None:
            progress(LoadProgress("weights", done, 4))
        if done < 4:
            time.sleep(sleep / 4)
    served = FakeServedModel(name, knobs)
    if context_length is not None:
        served.max_context = min(served.max_context, context_length)
    return served


def write_fake_checkpoint(directory: Path, **knobs) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "fake.json").write_text(json.dumps(knobs))
    (directory / "config.json").write_text("{}")
    return directory


# -- real daemon processes ----------------------------------------------------------------------

import os  # noqa: E402
import signal  # noqa: E402
import socket as socket_mod  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(value)


def toml_dumps(cfg: dict) -> str:
    lines = [f"{k} = {toml_value(v)}" for k, v in cfg.items() if not isinstance(v, (dict, list))]
    for name, table in cfg.items():
        if isinstance(table, dict):
            lines.append(f"[{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    for entry in cfg.get("models", []):
        lines.append("[[models]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def short_tempdir() -> Path:
    """A directory with a short path (a Unix socket path is at most 107 bytes), open to other users."""
    d = Path(tempfile.mkdtemp(prefix="npud-", dir="/tmp"))
    d.chmod(0o755)
    return d


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def kmsg_error(pid: int) -> str:
    """An amdxdna error line that names process `pid`'s hardware context ("hwctx.<pid>.<id>"):
    npud's own when `pid` is npud's (npud/guards.py counts only those)."""
    return f"amdxdna 0000:c5:00.1: [drm] *ERROR* job_timeout: timing out hwctx.{pid}.1 job 7"


KMSG_ERROR = kmsg_error(os.getpid())  # npud's own line, for a daemon run in this process
# a line that names no process: a foreign one, never a fault (npud/guards.py)
KMSG_FOREIGN_ERROR = "amdxdna 0000:c5:00.1: [drm] *ERROR* aie2_tdr_detect: TDR timeout detected"


# npud's command line with this module's fake engine as the model loader
FAKE_NPUD = "import sys, npud.main, test_npud_support; sys.exit(npud.main.main(loader=test_npud_support.load_model))"


class DaemonProc:
    """One `python -m npud` process with its own socket, state, sensor and kernel-log files;
    with `fake_engine` its models come from this module's fake engine."""

    def __init__(self, workdir: Path, models: list[dict], *, fake_engine: bool = False, **sections) -> None:
        self.dir = workdir
        self.fake_engine = fake_engine
        self.socket = str(workdir / "npud.sock")
        self.temp_file = workdir / "temp"
        self.kmsg = workdir / "kmsg"
        self.config_path = workdir / "npud.toml"
        self.log_path = workdir / "npud.log"
        self.set_temp(40.0)
        self.kmsg.write_text("")
        self._kmsg_seq = 0
        self.proc: subprocess.Popen | None = None
        self.config = {
            "server": {"socket_path": self.socket, "idle_timeout_s": 120.0, "line_timeout_s": 5.0,
                       "drain_timeout_s": 10.0},
            "limits": {"max_line_bytes": 65536},
            "store": {"state_dir": str(workdir / "state")},
            "scheduler": {"quantum_tokens": 100000, "quantum_ms": 600000.0},
            "thermal": {"psutil_chips": [], "hwmon_dir": "", "paths": [str(self.temp_file)], "hold_above_c": 90.0,
                        "resume_below_c": 85.0, "abort_above_c": 100.0, "poll_interval_s": 0.05},
            "errors": {"source": str(self.kmsg), "poll_interval_s": 0.05},
            "logging": {"format": "json", "level": "info"},
            "models": models,
        }
        self.write_config(**sections)

    def write_config(self, **sections) -> None:
        for name, values in sections.items():
            if isinstance(values, dict):
                self.config.setdefault(name, {}).update(values)
            else:
                self.config[name] = values
        self.config_path.write_text(toml_dumps(self.config))

    def argv(self) -> list[str]:
        """The daemon's command line (npud.main with the fake engine when fake_engine)."""
        npud = ["-c", FAKE_NPUD] if self.fake_engine else ["-m", "npud"]
        return [sys.executable, *npud, "--config", str(self.config_path)]

    def start(self, timeout: float = 60.0, *, env: dict[str, str] | None = None,
              stderr_path: Path | None = None) -> "DaemonProc":
        """Start and wait for `daemon_ready`; `env` adds variables, `stderr_path` keeps stderr
        out of the log (which then has stdout alone)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), **(env or {})}
        seen = len(self.logs())  # a restart must not take the last run's readiness for its own
        log = open(self.log_path, "ab")
        err = open(stderr_path, "ab") if stderr_path is not None else None
        self.proc = subprocess.Popen(self.argv(),
                                     stdout=log, stderr=subprocess.STDOUT if err is None else err, env=env,
                                     cwd=str(self.dir))
        log.close()
        if err is not None:
            err.close()

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"npud exited with {self.proc.returncode}:\n{self.log_tail()}")
            return any(e.get("event") == "daemon_ready" for e in self.logs()[seen:])

        wait_for(ready, timeout, what="npud to be ready")
        return self

    def client(self, timeout: float = 60.0):
        from npud.clients.client import Client

        return Client(self.socket, timeout=timeout)

    def raw(self, timeout: float = 10.0) -> socket_mod.socket:
        s = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(self.socket)
        return s

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def hup(self) -> None:
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> list[dict]:
        out = []
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def events(self, name: str) -> list[dict]:
        return [e for e in self.logs() if e.get("event") == name]

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def set_temp(self, celsius: float) -> None:
        tmp = self.temp_file.with_suffix(".new")
        tmp.write_text(f"{int(celsius * 1000)}\n")
        tmp.replace(self.temp_file)  # the guard never reads half a write

    @property
    def kmsg_error(self) -> str:
        """An error line of this daemon's own (it names the running daemon's pid)."""
        return kmsg_error(self.proc.pid)

    def add_kmsg(self, message: str) -> None:
        """Append one record in /dev/kmsg's format: priority,sequence,timestamp,flags;message."""
        self._kmsg_seq += 1
        with open(self.kmsg, "a") as f:
            f.write(f"3,{self._kmsg_seq},{int(time.monotonic() * 1e6)},-;{message}\n")


# -- the daemon in this process with the fake engine -------------------------------------------

def make_config(workdir, *, knobs=None, models=None, **sections):
    """A DaemonConfig for an in-process daemon on the fake model in `workdir` (thermal guard off)."""
    from npud.config import parse_config

    write_fake_checkpoint(workdir / "fake", **(knobs or {"tokens_per_round": 2}))
    (workdir / "kmsg").touch()
    raw = {
        "server": {"socket_path": str(workdir / "s.sock")},
        "store": {"state_dir": str(workdir / "state")},
        "thermal": {"enabled": False},
        "errors": {"source": str(workdir / "kmsg"), "poll_interval_s": 0.05},
        "models": models or [{"name": "fake", "checkpoint_dir": str(workdir / "fake")}],
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return parse_config(raw)


async def start(nursery, cfg, loader=load_model):
    """Run a Daemon with this module's fake engine (or `loader`) in `nursery`; returns it once it serves."""
    from npud.daemon import Daemon

    return await nursery.start(Daemon(cfg, loader=loader).run)


