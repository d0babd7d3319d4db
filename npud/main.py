"""`npud`: the command line. Exit codes: 0 clean stop, 1 failed at start-up, 2 bad configuration."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import trio

from engine.api import ModelLoader, load_model
from npud import __version__
from npud.config import DEFAULT_CONFIG_PATH, DaemonConfigError, DaemonConfig, check_models, load_config
from npud.logsetup import setup_logging
from npud.store import StoreError

EXIT_START_FAILED = 1
EXIT_BAD_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npud", description="Serve local LLMs on an AMD Ryzen AI NPU (or the CPU).")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH,
                   help=f"TOML configuration file (default {DEFAULT_CONFIG_PATH})")
    p.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    p.add_argument("--socket", help="override server.socket_path")
    p.add_argument("--state-dir", help="override store.state_dir")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="override logging.level")
    p.add_argument("--log-format", choices=("auto", "json", "console"), help="override logging.format")
    p.add_argument("--version", action="version", version=f"npud {__version__}")
    return p


def _overrides(args: argparse.Namespace):
    def apply(cfg: DaemonConfig) -> DaemonConfig:
        if args.socket:
            cfg = cfg.replace(server=dataclasses.replace(cfg.server, socket_path=args.socket))
        if args.state_dir:
            cfg = cfg.replace(store=dataclasses.replace(cfg.store, state_dir=args.state_dir))
        if args.log_level or args.log_format:
            cfg = cfg.replace(logging=dataclasses.replace(
                cfg.logging, level=args.log_level or cfg.logging.level, format=args.log_format or cfg.logging.format))
        return cfg
    return apply


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def main(argv: list[str] | None = None, *, loader: ModelLoader = load_model) -> int:
    """Run npud; returns the exit code. `loader` is where models come from (tests pass a fake engine's)."""
    args = _parser().parse_args(argv)
    overrides = _overrides(args)
    try:
        cfg = overrides(load_config(args.config))
    except DaemonConfigError as exc:
        hint = "; pass --config or create it (systemd/ has an example)" if exc.field == "--config" else ""
        print(f"npud: error: {exc}{hint}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.check_config:
        problems = check_models(cfg)
        for problem in problems:
            print(f"npud: error: {problem}", file=sys.stderr)
        if problems:
            return EXIT_BAD_CONFIG
        print(f"{args.config}: OK ({len(cfg.models)} model(s), socket {cfg.server.socket_path}, "
              f"state {cfg.store.state_dir})")
        return 0
    setup_logging(cfg.logging)
    from npud.daemon import Daemon  # after logging is set up: loggers are bound at import

    async def serve() -> None:
        daemon = Daemon(cfg, config_path=args.config, overrides=overrides, loader=loader)
        await daemon.run(handle_signals=True)

    try:
        trio.run(serve)
    except BaseException as exc:  # start-up failures arrive wrapped in exception groups
        leaves = _leaves(exc)
        if all(isinstance(e, (StoreError, RuntimeError, OSError)) for e in leaves):
            for e in leaves:
                print(f"npud: error: {e}", file=sys.stderr)
            return EXIT_START_FAILED
        raise
    return 0
