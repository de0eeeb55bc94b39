"""Ship ``l3plugin-autoload.pth`` into site-packages, for ``pip install .`` and ``pip install -e .`` alike.

The .pth runs ``import l3plugin_autoload`` at interpreter start, so the ``"l3plugin"`` DeepSpeed config key
works without ``import l3plugin.deepspeed`` (see l3plugin_autoload.py). setuptools has no option that puts a
file at the top of site-packages: a regular wheel gets it from ``build_py`` (everything in build_lib lands in
site-packages); an editable wheel does not install build_lib, so it gets the file added after it is built.
"""

import base64
import hashlib
import os
import time
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "l3plugin-autoload.pth"
HERE = Path(__file__).resolve().parent


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(str(HERE / PTH), os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]

    def get_source_files(self):
        return [*super().get_source_files(), PTH]


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite ``wheel`` with one more top-level file, listed in its RECORD (pip installs and uninstalls it)."""
    with zipfile.ZipFile(wheel) as old:
        entries = [(info, old.read(info)) for info in old.infolist()]
    record_name = next(info.filename for info, _ in entries if info.filename.endswith(".dist-info/RECORD"))
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as new:
        for info, content in entries:
            if info.filename == record_name:  # idempotent: an older line for the same file is dropped
                lines = [line for line in content.decode().splitlines() if line and not line.startswith(f"{name},")]
                content = "\n".join([*lines, f"{name},sha256={digest},{len(data)}", ""]).encode()
            if info.filename != name:
                new.writestr(info, content)
        new.writestr(name, data)
    tmp.replace(wheel)


cmdclass = {"build_py": build_py_with_pth}
try:  # setuptools >= 64 builds PEP 660 editable wheels with this command
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:
    editable_wheel = None

if editable_wheel is not None:
    class editable_wheel_with_pth(editable_wheel):
        def run(self):
            start = time.time() - 2  # the wheel is written during run(); 2 s for coarse file-system clocks
            super().run()
            built = [w for w in Path(self.dist_dir).glob("*.editable-*.whl") if w.stat().st_mtime >= start]
            if not built:
                raise RuntimeError(f"l3plugin setup.py: found no editable wheel in {self.dist_dir} to add {PTH} to")
            for wheel in built:
                add_to_wheel(wheel, PTH, (HERE / PTH).read_bytes())

    cmdclass["editable_wheel"] = editable_wheel_with_pth

setup(cmdclass=cmdclass)
