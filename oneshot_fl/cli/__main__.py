import sys

from oneshot_fl.cli import MOVED

sys.exit(f"oneshot-fl: error: {MOVED}: run the oneshot-fl command (or python -m launcher.cli)")
