import sys
from pathlib import Path

# tests import their builders (checkpoints.py, fakes) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))
