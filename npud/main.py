"""`npud`: the command line. Exit codes: 0 clean stop, 1 failed at start-up, 2 bad configuration.

The configuration file is --config, else $NPUD_CONFIG, else /etc/npud/npud.toml. `npud
--model PATH` with neither --config nor $NPUD_CONFIG needs no file: it serves that model as
whoever runs it, with the socket and the store in the XDG directories (npud/userdirs.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import sys
from pathlib import Path

import trio

from npud.engine.api import ModelLoader
from npud.engine.loader import load_model
from npud import __version__, userdirs
from npud.config import (DEFAULT_CONFIG_PATH, WEIGHT_FORMATS, DaemonConfigError, DaemonConfig, ModelEntry,
                         ServerConfig, StoreConfig, check_models, load_config, model_path)
from npud.packaged import PACKAGED
from npud.logsetup import plain_lines_fit, setup_logging
from npud.peers import raise_nofile_limit
from npud.store import StoreError

EXIT_START_FAILED = 1
EXIT_BAD_CONFIG = 2


class ModelOption(argparse.Action):
    """--model PATH: one entry of `args.models`, in order, that the options after it fill in."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        namespace.models = [*(getattr(namespace, "models", None) or []), {"path": value}]
        namespace.model = [*(namespace.model or []), value]


class PerModelOption(argparse.Action):
    """--weight-format / --threads: a setting of the --model given last before it, or of every
    --model when no --model comes before it (`args.model_defaults`)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        models = getattr(namespace, "models", None)
        if models:
            models[-1][self.dest] = value
        else:
            namespace.model_defaults = {**(getattr(namespace, "model_defaults", None) or {}), self.dest: value}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npud", description="Serve local LLMs on an AMD Ryzen AI NPU (or the CPU).")
    p.add_argument("--config", type=Path,
                   help=f"TOML configuration file (default $NPUD_CONFIG, else {DEFAULT_CONFIG_PATH}). Started by "
                        "hand (root too), npud keeps the socket and the store in your XDG directories "
                        "($XDG_RUNTIME_DIR/npud, ~/.local/state/npud) unless the file names others; "
                        "/run/npud and /var/lib/npud are the system service's")
    p.add_argument("--model", action=ModelOption, metavar="PATH",
                   help="serve this checkpoint: a directory, a .gguf file, a packaged model's short name "
                        f"({', '.join(PACKAGED)}), or a Hugging Face repo id (org/name) in the local Hugging Face "
                        "cache. Without --config and $NPUD_CONFIG no file is read and npud runs as you, listening "
                        "on $XDG_RUNTIME_DIR/npud/npud.sock; with one, the model is added before the configured "
                        "ones. Repeatable")
    p.add_argument("--weight-format", action=PerModelOption, choices=WEIGHT_FORMATS, metavar="FORMAT",
                   help="how the --model before it holds its weights (before any --model: every --model's): "
                        f"{', '.join(WEIGHT_FORMATS)}. A .gguf file keeps its blocks on the exact float path "
                        "unless gguf-q8 (faster: about 1.1x decode and 1.8x prefill on gemma-3-270m, a looser "
                        "parity bound; README, Exactness)")
    p.add_argument("--threads", action=PerModelOption, type=int, metavar="N",
                   help="host threads of the --model before it (before any --model: every --model's); "
                        "default $NPUD_HOST_THREADS, else the CPUs npud may use")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration, read every model's config, tokenizer and weight headers, and exit")
    p.add_argument("--socket", help="override server.socket_path")
    p.add_argument("--state-dir", help="override store.state_dir")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="override logging.level")
    p.add_argument("--log-format", choices=("auto", "json", "console"), help="override logging.format")
    p.add_argument("--version", action="version", version=f"npud {__version__}")
    return p


def _overrides(args: argparse.Namespace, models: tuple[ModelEntry, ...] = ()):
    """What the command line changes in a configuration (at start and at each SIGHUP): the
    flags, and the --model entries put before the configured models."""
    def apply(cfg: DaemonConfig) -> DaemonConfig:
        if models:
            cfg = cfg.replace(models=models + cfg.models)
        if args.socket:
            cfg = cfg.replace(server=dataclasses.replace(cfg.server, socket_path=args.socket))
        if args.state_dir:
            cfg = cfg.replace(store=dataclasses.replace(cfg.store, state_dir=args.state_dir))
        cfg = per_user(cfg)
        if args.log_level or args.log_format:
            cfg = cfg.replace(logging=dataclasses.replace(
                cfg.logging, level=args.log_level or cfg.logging.level, format=args.log_format or cfg.logging.format))
        return cfg
    return apply


def per_user(cfg: DaemonConfig) -> DaemonConfig:
    """A daemon that does not run as a systemd service (whose RuntimeDirectory= and
    StateDirectory= give it /run/npud and /var/lib/npud) keeps a socket and a store left at the
    system's defaults in its user's XDG directories instead (npud/userdirs.py), root's as anyone's:
    `npud --config FILE` started by hand never takes over the system daemon's socket or writes
    into its store. Paths the file sets to anything else (and --socket, --state-dir) stay."""
    if os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("STATE_DIRECTORY"):
        return cfg
    if cfg.server.socket_path == ServerConfig().socket_path:
        cfg = cfg.replace(server=dataclasses.replace(cfg.server, socket_path=str(userdirs.socket_path())))
    if cfg.store.state_dir == StoreConfig().state_dir:
        cfg = cfg.replace(store=dataclasses.replace(cfg.store, state_dir=str(userdirs.state_dir())))
    return cfg


NO_CONFIG_HELP = """npud: error: no configuration file ({path} does not exist). Either
  npud --model PATH    serve one model as yourself, no file needed (PATH: a checkpoint directory,
                       a .gguf file, or a Hugging Face repo id in the local cache), or
  npud --config FILE   run from a configuration file (or set NPUD_CONFIG=FILE); systemd/npud.toml
                       is the example and README.md says how to add a model to it."""


class NoConfig(Exception):
    """Neither a configuration file nor --model: nothing to serve."""


def model_entry(value: str, weight_format: str | None = None, threads: int | None = None) -> ModelEntry:
    """A --model argument as a model entry, named after its directory, file or repo (loaded at
    start), with its --weight-format and --threads. Raises DaemonConfigError naming what is wrong:
    a path that names nothing says which short names npud knows."""
    path = model_path("--model", value, None)
    if not os.path.exists(path):
        raise DaemonConfigError("--model", value, f"no such file or directory, and not a packaged model's short name "
                                                  f"({', '.join(PACKAGED)}) nor a Hugging Face repo id (org/name) "
                                                  "in the local cache; npud never downloads")
    stem = Path(value).name.removesuffix(".gguf")
    name = re.sub(r"[^A-Za-z0-9._-]", "-", stem).lstrip("._-")[:64] or "model"
    if weight_format == "gguf-q8" and not path.endswith(".gguf"):
        raise DaemonConfigError("--weight-format", weight_format, f"is for .gguf files; {value} is not one")
    if threads is not None and not 0 <= threads <= 1024:
        raise DaemonConfigError("--threads", threads, "must be in [0, 1024] (0: the default)")
    extra = {k: v for k, v in (("weight_format", weight_format), ("threads", threads)) if v is not None}
    return ModelEntry(name=name, checkpoint_dir=os.path.abspath(path), preload=True, **extra)


def model_entries(args: argparse.Namespace) -> tuple[ModelEntry, ...]:
    """The --model entries of the command line, each with its own --weight-format / --threads
    over the ones given before any --model."""
    defaults = getattr(args, "model_defaults", None) or {}
    models = getattr(args, "models", None) or []
    if defaults and not models:
        raise DaemonConfigError(f"--{next(iter(defaults)).replace('_', '-')}", next(iter(defaults.values())),
                                "applies to --model; the configuration file's models set it in their [[models]] table")
    return tuple(model_entry(m["path"], **{**defaults, **{k: v for k, v in m.items() if k != "path"}})
                 for m in models)


def user_config(socket: str | None, state_dir: str | None) -> DaemonConfig:
    """The configuration of a per-user npud without a file (its models come from --model): the
    defaults, the socket and store in the XDG directories (or where --socket / --state-dir say),
    the socket for this user only, and one prefix-cache budget (no other user to share it with)."""
    socket = socket or str(userdirs.socket_path())
    state_dir = state_dir or str(userdirs.state_dir())
    return DaemonConfig(server=ServerConfig(socket_path=socket, socket_mode=0o600),
                        store=StoreConfig(state_dir=state_dir, prefix_cache_users=0))


def _load(args: argparse.Namespace) -> tuple[DaemonConfig, Path | None]:
    """The configuration (overrides not yet applied, so without the --model entries) and the
    file it came from (None: no file).
    Raises DaemonConfigError, NoConfig, or UserDirError when no per-user directory is safe."""
    path = args.config or (Path(os.environ["NPUD_CONFIG"]).expanduser() if os.environ.get("NPUD_CONFIG") else None)
    if path is None and args.model:
        return user_config(args.socket, args.state_dir), None
    path = path or DEFAULT_CONFIG_PATH
    if path == DEFAULT_CONFIG_PATH and not path.exists():
        raise NoConfig(NO_CONFIG_HELP.format(path=path))
    return load_config(path), path


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _message(exc: BaseException) -> str:
    """A start-up failure as one line: an OS error as its path and its reason."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc)


def main(argv: list[str] | None = None, *, loader: ModelLoader = load_model) -> int:
    """Run npud; returns the exit code. `loader` is where models come from (tests pass a fake engine's)."""
    args = _parser().parse_args(argv)
    try:
        overrides = _overrides(args, model_entries(args))
        cfg, config_path = _load(args)
        cfg = overrides(cfg)
    except DaemonConfigError as exc:
        missing = exc.field == "--config" and not os.path.exists(str(exc.value))
        hint = "; pass --config or create it (systemd/ has an example)" if missing else ""
        print(f"npud: error: {exc}{hint}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except NoConfig as exc:
        print(exc, file=sys.stderr)
        return EXIT_BAD_CONFIG
    except userdirs.UserDirError as exc:
        print(f"npud: error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.check_config:
        problems = check_models(cfg)
        for problem in problems:
            print(f"npud: error: {problem}", file=sys.stderr)
        if problems:
            return EXIT_BAD_CONFIG
        print(f"{config_path or '--model'}: OK ({len(cfg.models)} model(s), socket {cfg.server.socket_path}, "
              f"state {cfg.store.state_dir})")
        return 0
    setup_logging(cfg.logging)
    raise_nofile_limit()  # one descriptor per connection: take what the hard limit (LimitNOFILE=) allows
    from npud.daemon import Daemon  # after logging is set up: loggers are bound at import

    started: list = []
    plain = plain_lines_fit(cfg.logging)

    async def serve() -> None:
        daemon = Daemon(cfg, config_path=config_path, overrides=overrides, loader=loader)
        if plain:  # else the log's own JSON lines say it (model_load_failed)
            daemon.announce = lambda line: print(f"npud: error: {line}", file=sys.stderr, flush=True)
        if not daemon.cache.trusted:  # the log has it too (cache_dir_refused)
            print(f"npud: warning: not using the cache directory {daemon.cache.configured}: {daemon.cache.refused}; "
                  "running without a cache (libraries are compiled at each start, nothing is kept)",
                  file=sys.stderr, flush=True)
        started.append(daemon)
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(daemon.run, handle_signals=True))
            # the log has it too (daemon_ready); this line is for whoever started npud by hand, and is
            # left out where it would sit among JSON log lines (the journal, `2>&1 | jq`)
            if plain:
                print(f"npud: listening on {cfg.server.socket_path} (models: {', '.join(daemon.registry.names) or 'none'}; "
                      f"state in {cfg.store.state_dir})", file=sys.stderr, flush=True)

    try:
        trio.run(serve)
    except BaseException as exc:  # start-up failures arrive wrapped in exception groups
        leaves = _leaves(exc)
        if all(isinstance(e, (StoreError, RuntimeError, OSError)) for e in leaves):
            for e in leaves:
                print(f"npud: error: {_message(e)}", file=sys.stderr)
            return EXIT_START_FAILED
        raise
    if started and started[0].start_failed:
        print("npud: error: no model loads, so there is nothing to serve; stopped", file=sys.stderr)
        return EXIT_START_FAILED
    return 0
