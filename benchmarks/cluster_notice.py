"""How late the driver learns that a cluster step ended: keel's state poll against Iris's own wait.

Each step sleeps a given time in an Iris job on an in-process local cluster (127.0.0.1,
tests/fixtures/iris_local.yaml) and writes the moment it ends; the figure is how long after that
moment `run_steps` returns. Baseline in the same run: the same steps waited on by fray's
`JobHandle.wait()` alone, whose Iris poll backs off 1.5x per poll up to 30 s apart (keel's poll,
`keel.executor.cluster.STATE_POLL_MAX_S`, is switched off for it). Both include the worker's report
of the task's end to the controller. The ratio prints last.

    uv run python benchmarks/cluster_notice.py [--seconds 2 10 40]
"""

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import cloudpickle

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the local cluster harness the tests use

from iris_local import local_iris_client  # noqa: E402

from keel import Resources, Step, this_output  # noqa: E402
from keel.executor import cluster  # noqa: E402
from keel.executor.run import run_steps  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # cluster tasks cannot import benchmarks/


@dataclass(frozen=True)
class SleepConfig:
    seconds: float
    waited_by: str  # a different output for each way of waiting
    output_path: str = this_output()


def sleep_then_note_the_end(config: SleepConfig) -> None:
    time.sleep(config.seconds)
    with open(os.path.join(config.output_path, "ended"), "w") as f:
        f.write(repr(time.time()))


def noticed_late(client, prefix: str, seconds: float, waited_by: str) -> float:
    """Seconds between the step's end and `run_steps` returning."""
    step = Step(f"sleep/{waited_by}-{seconds:g}", sleep_then_note_the_end, SleepConfig(seconds, waited_by),
                resources=Resources(cpu=1))
    report = run_steps([step], prefix, cluster=client, echo=lambda _: None)
    returned = time.time()
    assert report.ok, report.failures
    [output] = Path(prefix).glob(f"sleep/{waited_by}-{seconds:g}-*")
    return returned - float((output / "ended").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, nargs="+", default=[2.0, 10.0, 40.0])
    args = parser.parse_args()
    keel_poll = cluster._wait_until_finished
    late = {"iris": [], "keel": []}
    with tempfile.TemporaryDirectory() as tmp, local_iris_client(Path(tmp, "iris")) as (_, client):
        for seconds in args.seconds:
            cluster._wait_until_finished = lambda *_, **__: None  # baseline: handle.wait() alone
            late["iris"].append(noticed_late(client, f"{tmp}/out", seconds, "iris"))
            cluster._wait_until_finished = keel_poll
            late["keel"].append(noticed_late(client, f"{tmp}/out", seconds, "keel"))
            print(f"a {seconds:g} s step noticed: Iris's wait {late['iris'][-1]:5.2f} s late, "
                  f"keel's poll {late['keel'][-1]:5.2f} s late", flush=True)
    print(f"ratio of the lateness, Iris's wait / keel's poll (summed over {len(args.seconds)} steps): "
          f"{sum(late['iris']) / sum(late['keel']):.1f}x")


if __name__ == "__main__":
    main()
