import sys

from oneshot_fl.deploy import HOW, MOVED

sys.exit(f"oneshot-fl-deploy: error: {MOVED}: {HOW}")
