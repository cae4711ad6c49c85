"""Python's cycle collector around a step's imports: a step whose function is named
(`StepFunction`) imports its module with the collector held, and an isolated step's process then
freezes what that import built out of the collector's reach (it lives as long as the process),
before the collector resumes. A step run in the launcher's own process imports the same way but
freezes nothing: the launcher's garbage is not the step's to keep."""

import json
import os
import subprocess
import sys
from pathlib import Path

STEP_MODULE = '''
import gc
import json
import os

IMPORTED_WITH_COLLECTOR = gc.isenabled()
BUILT_AT_IMPORT = [{"row": i} for i in range(10_000)]  # containers the collector would track
for _ in range(5_000):  # garbage that only a collection walking the import's objects frees
    cycle = []
    cycle.append(cycle)
del cycle
COLLECTED_BY_IMPORT = sum(generation["collected"] for generation in gc.get_stats())


def report(config):
    with open(os.path.join(config.output_path, "gc.json"), "w") as f:
        json.dump({"imported_with_collector": IMPORTED_WITH_COLLECTOR, "collector_on": gc.isenabled(),
                   "frozen": gc.get_freeze_count(),
                   "collected_since": sum(g["collected"] for g in gc.get_stats()) - COLLECTED_BY_IMPORT}, f)
'''

EXPERIMENT = '''
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from keel import Step, StepFunction, main, this_output


@dataclass(frozen=True)
class Where:
    process: str
    output_path: str = this_output()


report = StepFunction("gc_report:report")
steps = [Step("gc/isolated", report, Where("own"), isolated=True), Step("gc/in_launcher", report, Where("launcher"))]

if __name__ == "__main__":
    main(steps)
'''


def test_a_step_imports_its_function_without_the_collector_and_its_own_process_freezes_the_import(tmp_path: Path):
    (tmp_path / "gc_report.py").write_text(STEP_MODULE)
    (tmp_path / "exp.py").write_text(EXPERIMENT)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run([sys.executable, "-m", "keel.cli_entry", "run", str(tmp_path / "exp.py"), "--prefix",
                             str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    [isolated] = (tmp_path / "out/gc").glob("isolated-*")
    [in_launcher] = (tmp_path / "out/gc").glob("in_launcher-*")
    own, launcher = (json.loads((path / "gc.json").read_text()) for path in (isolated, in_launcher))
    assert own["imported_with_collector"] is False and launcher["imported_with_collector"] is False
    assert own["collector_on"] and launcher["collector_on"]  # back on for the step itself
    assert own["frozen"] > 10_000  # at least the module's own rows
    # frozen before the collector resumed: no collection walked the import once more on the way (its
    # 5,000 garbage cycles are kept with it instead)
    assert own["collected_since"] < 5_000, own
    assert launcher["frozen"] < 10_000  # not them (Python's own startup may have frozen a few hundred objects)
