"""TEST-ONLY: imports deepspeed at its top, so that deepspeed finishes importing while an l3plugin module
(this one) is half-built: the autoload hook must then wait for the first ``deepspeed.initialize``
(tests/test_autoload.py)."""

import deepspeed  # noqa: F401
