"""Where things are: the repository root."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
