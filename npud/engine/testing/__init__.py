"""Fixtures shared by tests/ and bench/: tiny checkpoints built on the fly (checkpoints.py).

Inside the installed package so both import it as `npud.engine.testing.checkpoints` without any
sys.path edits. Nothing in the engine imports it; its builders import tokenizers, torch and
transformers (test-only dependencies) when called, never at import.
"""
