"""Make torchvision importable next to a CPU-only torch when only PyPI's torchvision is at hand.

PyPI's Linux torchvision wheels are CUDA builds: their C++ ops (_C.so) link libtorch_cuda and
libcudart and cannot load next to a CPU-only torch (e.g. torch-2.13.0+cpu from a local wheel folder
when PyTorch's CPU index, which has a matching torchvision+cpu, is out of reach). torchvision then
still works for what oneshot-fl uses (models, transforms, datasets) except that its
`_meta_registrations.py` registers two fake kernels (nms, qnms) without the `_has_ops()` guard its
other registrations have, so `import torchvision` fails with "operator torchvision::nms does not
exist". This guards those two registrations the same way. Detection ops (nms, roi_align, ...) stay
unavailable; oneshot-fl calls none.

Run at image build time (deploy/Dockerfile.superexec); does nothing when torchvision imports.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

CHECK = "import torchvision, torchvision.models, torchvision.datasets, torchvision.utils"


def main() -> int:
    if subprocess.run([sys.executable, "-c", CHECK], capture_output=True).returncode == 0:
        print("torchvision imports as installed; nothing to guard")
        return 0
    path = Path(importlib.util.find_spec("torchvision").origin).parent / "_meta_registrations.py"
    text = path.read_text()
    guarded, count = re.subn(r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$',
                             r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))",
                             text, flags=re.M)
    if not count:
        print(f"{path}: no unguarded register_fake found; torchvision fails to import for another reason",
              file=sys.stderr)
        return 1
    path.write_text(guarded)
    done = subprocess.run([sys.executable, "-c", CHECK + "; print('ops:', torchvision.extension._has_ops())"],
                          capture_output=True, text=True)
    print(f"guarded {count} fake-kernel registration(s) in {path}: {done.stdout.strip()} {done.stderr[-2000:]}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
