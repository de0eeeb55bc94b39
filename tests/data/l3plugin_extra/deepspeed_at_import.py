"""TEST-ONLY: imported as ``l3plugin.deepspeed_at_import`` (tests/test_autoload.py appends this folder to the
package's ``__path__`` in its child interpreter; the package itself does not ship it). It imports deepspeed at its
top, so that deepspeed finishes importing while an l3plugin module (this one) is half-built: the autoload hook must
then wait for the first ``deepspeed.initialize``."""

import deepspeed  # noqa: F401
