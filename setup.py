"""Packaging beyond pyproject.toml: the start-up hook ``hf_paged_backend.pth`` goes to the top
of site-packages, in a wheel and in an editable install alike.

Python runs a ``.pth`` file's ``import`` lines at every start. This one reads
``HF_PAGED_BACKEND`` and, only when it is set, imports ``_hf_paged_startup`` (which imports
hf_paged, so the switch acts in a program that never imports hf_paged). Unset, it costs one
dictionary lookup. ``pip uninstall hf-paged`` removes it with the rest.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "hf_paged_backend.pth"


class BuildPyWithPth(build_py):
    """A wheel: the .pth beside the packages, at the top of the wheel."""

    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    """An editable install (``pip install -e .``): setuptools puts only its own path hook in
    the wheel, so the .pth is added to the wheel's top next to it."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(PTH, os.path.join(unpacked_wheel, PTH))
        return result


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
