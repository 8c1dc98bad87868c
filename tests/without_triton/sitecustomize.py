"""With this folder on ``PYTHONPATH``, every Python process started (the test processes and the
benchmark scripts the tests run) finds no triton, as an install without the ``gpu`` extra:
``import triton`` raises ``ImportError``. See README.md, "Test"."""

import sys

sys.modules["triton"] = None
