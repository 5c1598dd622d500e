"""Only what pyproject.toml cannot say: install `gpn_scale_lm_eval.pth` into site-packages
(wheel and editable installs), so the `lm_eval` CLI finds `--model gpn_scale`
(gpn_scale/eval/lm_eval_hook.py says why a .pth)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "gpn_scale_lm_eval.pth"
HOOK = "gpn_scale.eval.lm_eval_hook"
# One line, run by `site` at interpreter start; does nothing when gpn_scale is not importable.
LINE = f'import importlib.util as u; u.find_spec("gpn_scale") and __import__("{HOOK}")\n'


class BuildPyWithPth(build_py):
    """Wheels: the .pth sits at the wheel's root, which installs into site-packages."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            (Path(self.build_lib) / PTH).write_text(LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib) / PTH)]


class EditableWheelWithPth(editable_wheel):
    """Editable installs: setuptools writes only its own .pth; add ours to the same root."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        (Path(unpacked_wheel) / PTH).write_text(LINE)
        return result


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
