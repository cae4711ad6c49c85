"""The catalogue of bad inputs and faults keel meets, each reproduced as a user meets it: an
experiment file and a `keel` command line, run in a process of its own with a clean environment.

Every entry of CATALOGUE must end in one of two ways, never in a traceback and never in SUCCESS:
- "error": exit code 2 and one `keel: error:` block naming the mistake and its fix, before any step runs;
- "failed": exit code 1, the step FAILED with the cause in the report.

Add an entry when a new bad input is found; cases that need several commands (run, then damage an
output, then run again) follow the catalogue as their own tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEADER = '''
import os
from dataclasses import dataclass

from keel import External, Step, main, output_of, this_output


@dataclass(frozen=True)
class C:
    n: int
    inputs: tuple = ()
    output_path: str = this_output()


def write(config):
    os.makedirs(config.output_path, exist_ok=True)
    with open(os.path.join(config.output_path, "n.txt"), "w") as f:
        f.write(str(config.n))

'''

GOOD = 'a = Step("x/a", write, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n'
MAIN = '\nif __name__ == "__main__":\n    main([b])\n'


@dataclass(frozen=True)
class BadInput:
    name: str
    body: str
    """The experiment file after HEADER."""
    argv: tuple[str, ...]
    """After `keel`; EXP stands for the experiment file (outputs go under the test's folder)."""
    outcome: str  # "error" | "failed"
    says: str
    """A phrase the report must contain."""


CATALOGUE = [
    # --- steps that did the wrong thing and used to be SUCCESS
    BadInput("step writes nothing", 'def nothing(config):\n    pass\na = Step("x/a", nothing, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("run", "EXP"), "failed", "wrote no files under its output path"),
    BadInput("step writes beside its folder",
             'def beside(config):\n    write(config)\n    open(os.path.join(config.output_path, "..", "stray.txt"), "w").write("x")\n'
             'a = Step("x/a", beside, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("run", "EXP"), "failed", "wrote stray.txt beside its output folder"),
    BadInput("step deletes its output folder and makes it again",
             'import shutil\ndef fresh(config):\n    shutil.rmtree(config.output_path)\n    write(config)\n'
             'a = Step("x/a", fresh, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("run", "EXP"), "failed", "the step removed .keel/ from its output folder"),
    BadInput("isolated step deletes its output folder and makes it again",
             'import shutil\ndef fresh(config):\n    shutil.rmtree(config.output_path)\n    write(config)\n'
             'a = Step("x/a", fresh, C(1), isolated=True)\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("run", "EXP"), "failed", "the step removed .keel/ from its output folder"),
    BadInput("isolated step writes to /tmp",
             'def elsewhere(config):\n    write(config)\n    stray = f"/tmp/keel-elsewhere-{os.getpid()}.txt"\n'
             '    open(stray, "w").write("x")\n    os.remove(stray)\n'
             'a = Step("x/a", elsewhere, C(1), isolated=True)\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("run", "EXP"), "failed", "/tmp/keel-elsewhere-"),
    BadInput("step returns a value", 'def answer(config):\n    write(config)\n    return 42\na = Step("x/a", answer, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("run", "EXP"), "failed", "returned 42, which keel would drop"),
    BadInput("os._exit in a launcher step", 'def bye(config):\n    write(config)\n    os._exit(0)\na = Step("x/a", bye, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("run", "EXP"), "failed", "called os._exit(0)"),
    BadInput("--set of the output path", GOOD + MAIN, ("run", "EXP", "--set", "x/a.output_path=/tmp/elsewhere"), "error",
             "is a path keel fills in"),
    BadInput("--set inside the output path", GOOD + MAIN, ("run", "EXP", "--set", "x/a:output_path.subpath=../x"), "error",
             "--set x/a:output_path.subpath=../x: output_path is a path keel fills in (this_output())"),
    BadInput("a topology this machine lacks",
             'from keel.spec import RackTopology, TopologyError\n'
             'def train(config):\n    raise TopologyError("RackTopology: 1 devices are present but racks=11 x gpus_per_rack=64 = 704")\n'
             'b = Step("train/hero", train, C(1))\ntwin = Step("train/twin", write, C(1))\n'
             'if __name__ == "__main__":\n    main([b], scales={"tiny": lambda: [twin]})\n',
             ("run", "EXP"), "failed", "--scale tiny`"),
    BadInput("a literal output path", 'a = Step("x/a", write, C(1, output_path="/tmp/elsewhere"))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("plan", "EXP"), "error", "config.output_path='/tmp/elsewhere', but the field is where keel puts the step's outputs"),
    # --- mistakes in the experiment file
    BadInput("invalid TrainConfig value", 'from keel.spec import TrainConfig\nTrainConfig(batch_size=8, seq_len=16, num_steps=0)\n' + GOOD + MAIN,
             ("plan", "EXP"), "error", "num_steps=0 must be positive"),
    BadInput("an Adam beta of 1 or more", 'from keel.spec import AdamWConfig\nAdamWConfig(beta2=1.5)\n' + GOOD + MAIN,
             ("plan", "EXP"), "error", "AdamWConfig.beta2=1.5 must lie in [0, 1)"),
    BadInput("a negative eval_batches", 'from keel.spec import TrainConfig\nTrainConfig(batch_size=8, seq_len=16, num_steps=4, eval_batches=-1)\n' + GOOD + MAIN,
             ("plan", "EXP"), "error", "TrainConfig.eval_batches=-1 must be >= 0"),
    BadInput("a dtype spelled as a short name", 'from keel.spec import TrainConfig\nTrainConfig(batch_size=8, seq_len=16, num_steps=4, master_dtype="fp32")\n' + GOOD + MAIN,
             ("plan", "EXP"), "error", "TrainConfig.master_dtype='fp32' is not a dtype keel trains in: use bfloat16, float16 or float32"),
    BadInput("the LR law given the run's size (the rates resolve from the run itself)",
             'from defaults.models import tiny_moe\nfrom defaults.optimizers import hero_lr_law\n'
             'hero_lr_law.optimizer(tiny_moe, batch_size=0, seq_len=16, num_steps=10)\n' + GOOD + MAIN,
             ("plan", "EXP"), "error", "LrScalingLaw.optimizer() takes no model, batch_size, seq_len or num_steps"),
    BadInput("validation fraction above 1", 'from defaults import ingest\ningest("d", ("x.jsonl",), validation_fraction=1.5)\n' + GOOD + MAIN,
             ("plan", "EXP"), "error", "validation_fraction"),
    BadInput("tokenizer vocabulary too small", 'from keel.data.tokenizer import TrainTokenizerConfig\nTrainTokenizerConfig(documents="d", vocab_size=100)\n' + GOOD + MAIN,
             ("plan", "EXP"), "error", "vocab_size=100 is too small"),
    BadInput("typo'd keyword", 'a = Step("x/a", write, C(n=1, imputs=()))\n' + MAIN, ("plan", "EXP"), "error",
             "unexpected keyword argument 'imputs'; did you mean inputs?"),
    BadInput("a keyword no field is near", 'a = Step("x/a", write, C(n=1, colour=()))\n' + MAIN, ("plan", "EXP"), "error",
             "unexpected keyword argument 'colour'; C's fields are n, inputs, output_path"),
    BadInput("a --set value of the wrong type", GOOD + MAIN, ("plan", "EXP", "--set", "x/a:n=abc"), "error",
             "cannot read 'abc' as an int"),
    BadInput("a --set giving a whole config one plain value",
             '@dataclass(frozen=True)\nclass Outer:\n    inner: C\n    output_path: str = this_output()\n\n'
             'o = Step("x/o", lambda config: write(config.inner), Outer(C(1)))\n' + MAIN.replace("[b]", "[o]"),
             ("plan", "EXP", "--set", "x/o:inner=adam"), "error",
             "inner is a config (C), not one value: set one of its fields (x/o:inner.n=...) or give the whole config "
             "as a mapping of its fields (x/o:inner={n: ...})"),
    BadInput("syntax error", 'a = Step("x/a", write, C(1)\n' + MAIN, ("plan", "EXP"), "error", "SyntaxError"),
    BadInput("missing import", 'a = Step("x/a", write, Config(1))\n' + MAIN, ("plan", "EXP"), "error", "name 'Config' is not defined"),
    BadInput("wrong type in a config", 'a = Step("x/a", write, C(n="100"))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN,
             ("plan", "EXP"), "error", "config.n='100' is a str, but the field is declared int"),
    BadInput("a directory as an input", 'from defaults import ingest\nos.makedirs("corpus", exist_ok=True)\nb = ingest("d", ("corpus",))\n' + MAIN,
             ("plan", "EXP"), "error", "is a directory, not a file: give a glob of its files"),
    BadInput("External with no files", 'e = External("raw", "empty-data")\nb = Step("x/b", write, C(2, (output_of(e),)))\n' + MAIN,
             ("run", "EXP"), "error", "no files at the path of external input raw"),
    # --- the command line
    BadInput("--cluster not a URL", GOOD + MAIN, ("run", "EXP", "--cluster", "notaurl"), "error", "--cluster notaurl: not a controller URL"),
    BadInput("--only matching no step", GOOD + MAIN, ("run", "EXP", "--only", "nothing-like-this"), "error", "matches no step"),
    BadInput("--force matching no step (a typo)", GOOD + MAIN, ("run", "EXP", "--force", "x/bb"), "error",
             "--force 'x/bb' matches no step"),
    BadInput("--port out of range", GOOD + MAIN, ("dashboard", "EXP", "--port", "70000"), "error", "give a TCP port"),
    BadInput("a scale's function fails", GOOD + '\nif __name__ == "__main__":\n    main([b], scales={"tiny": lambda: [b, 1 / 0]})\n',
             ("plan", "EXP", "--scale", "tiny"), "error", "ZeroDivisionError: division by zero"),
    BadInput("a scale's function returns a step", GOOD + '\nif __name__ == "__main__":\n    main([b], scales={"tiny": lambda: b})\n',
             ("plan", "EXP", "--scale", "tiny"), "error", "returned Step; return a list of steps"),
    BadInput("--max-concurrent 0", GOOD + MAIN, ("run", "EXP", "--max-concurrent", "0"), "error", "give at least 1"),
    BadInput("a repeated --set", GOOD + MAIN, ("plan", "EXP", "--set", "x/a.n=3", "--set", "x/a.n=4"), "error", "is given twice"),
    BadInput("an empty --prefix", GOOD + MAIN, ("plan", "EXP", "--prefix", ""), "error", "--prefix is empty"),
    BadInput("status --yes", GOOD + MAIN, ("status", "EXP", "--yes"), "error", "--yes does nothing for `keel status`"),
    BadInput("gc --force", GOOD + MAIN, ("gc", "EXP", "--force", "x"), "error", "--force does nothing for `keel gc`"),
    BadInput("run --json", GOOD + MAIN, ("run", "EXP", "--json"), "error", "--json does nothing for `keel run`"),
]


def clean_env() -> dict[str, str]:
    """The environment of a user's shell: none of the test session's device or platform settings."""
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def keel(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`keel ARGV` in `tmp_path`, EXP standing for the experiment; outputs under `tmp_path/out`
    unless ARGV gives a --prefix."""
    args = [str(tmp_path / "exp.py") if a == "EXP" else a for a in argv]
    if "--prefix" not in argv:
        args += ["--prefix", str(tmp_path / "out")]
    return subprocess.run([sys.executable, "-m", "keel.cli_entry", *args], cwd=tmp_path, env={**clean_env(), **(env or {})},
                          capture_output=True, text=True, timeout=300)


def write_experiment(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "exp.py"
    path.write_text(HEADER + body)
    return path


def assert_error(result: subprocess.CompletedProcess, says: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.stderr.startswith("keel: error: ") and result.stderr.count("keel: error:") == 1, result.stderr
    assert says in result.stderr, result.stderr
    assert "[keel] start" not in result.stdout, result.stdout


def assert_failed(result: subprocess.CompletedProcess, says: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert "[keel] FAIL" in result.stdout and "0 ran" in result.stdout, result.stdout
    assert says in result.stderr, result.stderr


@pytest.mark.parametrize("isolated", [False, True])
def test_a_step_that_writes_into_another_steps_output_fails(tmp_path, isolated):
    """The prefix here is under the temporary directory, where a step may write: a file planted in a
    finished neighbour's folder is in none of its manifests, so nothing else would see it."""
    write_experiment(tmp_path, 'def plant(config):\n    write(config)\n'
                     '    open(os.path.join(config.inputs[0], "planted.txt"), "w").write("x")\n'
                     f'a = Step("x/a", write, C(1))\nb = Step("x/b", plant, C(2, (output_of(a),)), isolated={isolated})\n' + MAIN)
    result = keel(tmp_path, "run", "EXP")
    assert result.returncode == 1 and "[keel] FAIL  x/b" in result.stdout, result.stdout + result.stderr
    (planted,) = (tmp_path / "out" / "x").glob("a-*/planted.txt")
    assert f"the step wrote {planted} outside its output path" in result.stderr, result.stderr


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.name for c in CATALOGUE])
def test_catalogue(tmp_path, case):
    write_experiment(tmp_path, case.body)
    result = keel(tmp_path, *case.argv)
    (assert_error if case.outcome == "error" else assert_failed)(result, case.says)


SCRIPT_MODE = [c for c in CATALOGUE if c.outcome == "error" and c.name != "syntax error"]
"""The same mistakes met as `python EXP.py CMD` (the file's own `keel.main`); a syntax error in the
file itself stops Python before keel runs, so Python reports it (file, line and caret, exit 1)."""


@pytest.mark.parametrize("case", SCRIPT_MODE, ids=[c.name for c in SCRIPT_MODE])
def test_catalogue_as_a_script(tmp_path, case):
    write_experiment(tmp_path, case.body)
    args = [str(tmp_path / "exp.py") if a == "EXP" else a for a in case.argv]
    args = [args[1], args[0], *args[2:]] + ([] if "--prefix" in args else ["--prefix", str(tmp_path / "out")])
    result = subprocess.run([sys.executable, *args], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert_error(result, case.says)


def status_of(tmp_path: Path, name: str) -> dict:
    [path] = (tmp_path / "out").glob(f"{name}-*/.keel/status")
    return json.loads(path.read_text())


def test_a_step_that_wrote_nothing_reruns_once_fixed(tmp_path):
    write_experiment(tmp_path, 'def nothing(config):\n    pass\na = Step("x/a", nothing, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN)
    assert_failed(keel(tmp_path, "run", "EXP"), "declare Step(..., no_outputs=True)")
    write_experiment(tmp_path, 'a = Step("x/a", write, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN)
    again = keel(tmp_path, "run", "EXP")
    assert again.returncode == 0 and "2 ran" in again.stdout, again.stdout + again.stderr


def test_a_launcher_step_writing_into_the_working_directory_fails(tmp_path):
    """In the launcher's threads the system temp dir is shared, so only writes outside it and the
    output are caught; the test's folder is in /tmp, so the system temp dir is moved away here."""
    (tmp_path / "systmp").mkdir()
    write_experiment(tmp_path, 'def here(config):\n    write(config)\n    open("results.json", "w").write("{}")\n'
                               'a = Step("x/a", here, C(1))\nb = Step("x/b", write, C(2, (output_of(a),)))\n' + MAIN)
    result = keel(tmp_path, "run", "EXP", env={"TMPDIR": str(tmp_path / "systmp")})
    assert_failed(result, f"the step wrote {tmp_path / 'results.json'} outside its output path: a step writes only under "
                          "config.output_path")
    assert (tmp_path / "results.json").exists()  # left where it is, for the user to move


def test_writes_libraries_make_on_their_own_are_not_outside(tmp_path):
    """Temporary files, the user's caches, bytecode and a step declared without outputs are no stray writes."""
    (tmp_path / "systmp").mkdir()
    write_experiment(tmp_path, '''
import tempfile


def libraries(config):
    write(config)
    fd, name = tempfile.mkstemp()
    os.write(fd, b"x")
    os.close(fd)
    with tempfile.NamedTemporaryFile("w") as f:
        f.write("x")
    cache = os.path.join(os.environ["XDG_CACHE_HOME"], "some-library")
    os.makedirs(cache, exist_ok=True)
    open(os.path.join(cache, "index.json"), "w").write("{}")
    import importlib, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)) if "__file__" in globals() else os.getcwd())
    importlib.import_module("helper")  # writes __pycache__/helper.cpython-*.pyc beside it


def notify(config):
    open(os.path.join(os.environ["HOME"], "notified"), "w").write("x")


a = Step("x/a", libraries, C(1), isolated=True)
b = Step("x/b", libraries, C(2, (output_of(a),)))
c = Step("x/c", notify, C(3, (output_of(b),)), no_outputs=True)
if __name__ == "__main__":
    main([c])
''')
    (tmp_path / "helper.py").write_text("X = 1\n")
    env = {"TMPDIR": str(tmp_path / "systmp"), "XDG_CACHE_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path / "home"),
           "PYTHONDONTWRITEBYTECODE": ""}
    (tmp_path / "home").mkdir()
    result = keel(tmp_path, "run", "EXP", env=env)
    assert result.returncode == 0 and "3 ran" in result.stdout, result.stdout + result.stderr
    assert list((tmp_path / "__pycache__").glob("helper.*.pyc"))


def test_a_write_by_the_real_path_of_an_output_reached_through_a_link_is_the_steps_own(tmp_path, monkeypatch):
    """A prefix through a symbolic link (macOS's /tmp, a mounted bucket): the output written by its
    resolved path is the step's; a file beside it, by either path, is outside."""
    import tempfile

    from keel.executor.writes import _Watch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systmp"))  # tmp_path itself is in the temp dir
    real = tmp_path / "real"
    (real / "out").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    watch = _Watch(str(tmp_path / "link" / "out"))
    for path in (real / "out" / "data.txt", tmp_path / "link" / "out" / "more.txt", real / "beside.txt",
                 tmp_path / "link" / "beside2.txt"):
        watch.saw(str(path))
    assert watch.outside == [str(real / "beside.txt"), str(tmp_path / "link" / "beside2.txt")]


def test_a_step_that_warns_is_success_with_its_warnings_in_the_summary_and_status(tmp_path):
    """`keel.executor.warn` (a flat loss, a rollback): the step is SUCCESS and cached, and both the
    `keel run` summary and `keel status` say what to look at; from any thread of an isolated step."""
    write_experiment(tmp_path, '''
import threading

from keel.executor import warn


def flat(config):
    write(config)
    warn("loss flat at 6.9315 from step 0 to 30: lower the learning rate")


def in_a_thread(config):
    write(config)
    thread = threading.Thread(target=warn, args=("rolled back at step 12",))
    thread.start()
    thread.join()


a = Step("x/a", flat, C(1))
b = Step("x/b", in_a_thread, C(2, (output_of(a),)), isolated=True)
''' + MAIN)
    result = keel(tmp_path, "run", "EXP")
    assert result.returncode == 0 and "2 ran" in result.stdout, result.stdout + result.stderr
    assert "[keel] done  x/a in" in result.stdout and "with 1 warning: loss flat at 6.9315" in result.stdout, result.stdout
    assert "2 finished with warnings (below)" in result.stdout, result.stdout
    assert "keel: warning: step x/a is SUCCESS with 1 warning:\n  warning: loss flat at 6.9315 from step 0 to 30: lower the " \
           "learning rate\n  output: " in result.stderr, result.stderr
    assert "keel: warning: step x/b is SUCCESS with 1 warning:\n  warning: rolled back at step 12" in result.stderr, result.stderr
    assert status_of(tmp_path, "x/a")["state"] == "SUCCESS"
    assert status_of(tmp_path, "x/b")["warnings"] == ["rolled back at step 12"]
    status = keel(tmp_path, "status", "EXP")
    assert "2 cached" in status.stdout and "warning: loss flat at 6.9315" in status.stdout, status.stdout
    listed = json.loads(keel(tmp_path, "status", "EXP", "--json").stdout)["steps"]
    assert [s.get("warnings") for s in listed] == [["loss flat at 6.9315 from step 0 to 30: lower the learning rate"],
                                                   ["rolled back at step 12"]]


@pytest.mark.slow
def test_a_run_that_never_learns_is_success_with_a_warning_in_the_summary(tmp_path):
    """A learning rate 1e8 x the law's: the loss stays at ln(vocab); the run says so at its end, not only in its log.

    The run is the own-data tutorial's model, vocabulary, batch and compute dtype, so its training
    step and initial state are the programs that tutorial compiles once for the session (the rates
    are inputs)."""
    write_experiment(tmp_path, f'''
from defaults import default_tokenize, default_tokenizer, default_train, ingest
from defaults.models import tiny_moe
from defaults.optimizers import hero_lr_law
from keel.spec import TrainConfig

documents = ingest("own-notes", ("{REPO}/experiments/tutorials/data/own_corpus.jsonl",), text_field="body",
                   validation_fraction=0.05)
tokenizer = default_tokenizer("own-notes-bpe-384", documents, vocab_size=384)
tokens = default_tokenize("own-notes-bpe-384-64", documents, tokenizer, seq_len=64)
train = TrainConfig(batch_size=16, num_steps=12, optimizer=hero_lr_law.optimizer(scale=1e8), eval_every=12,
                    eval_batches=0, rolling_checkpoint_minutes=None, compute_dtype="float32")
b = default_train("sweep/lr-huge", data=tokens, model=tiny_moe.replace(vocab_size=384), train=train)
''' + MAIN)
    result = keel(tmp_path, "run", "EXP", env={"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0 and "1 finished with warnings (below)" in result.stdout, result.stdout + result.stderr
    assert "keel: warning: step train/sweep/lr-huge is SUCCESS with 1 warning:\n  warning: the training loss never went 1% " \
           "below its first value" in result.stderr, result.stderr
    assert "lowest 5.95" in result.stderr and "check the learning rate" in result.stderr, result.stderr
    status = keel(tmp_path, "status", "EXP")
    assert "warning: the training loss never went 1% below its first value" in status.stdout, status.stdout


def test_a_step_declared_without_outputs_succeeds(tmp_path):
    write_experiment(tmp_path, 'def check(config):\n    pass\nb = Step("x/check", check, C(1), no_outputs=True)\n' + MAIN)
    result = keel(tmp_path, "run", "EXP")
    assert result.returncode == 0 and "1 ran" in result.stdout, result.stdout + result.stderr
    assert status_of(tmp_path, "x/check")["state"] == "SUCCESS"


def test_an_output_rewritten_in_place_at_the_same_size_is_not_cached(tmp_path):
    write_experiment(tmp_path, GOOD + MAIN)
    assert keel(tmp_path, "run", "EXP").returncode == 0
    [output] = (tmp_path / "out").glob("x/a-*/n.txt")
    os.utime(output, (1, 1))  # touched, same content: re-hashed once, still cached
    assert "2 cached" in keel(tmp_path, "plan", "EXP").stdout
    output.write_text("7")  # same size, other content
    plan = keel(tmp_path, "plan", "EXP")
    assert "was changed after the step finished" in plan.stdout, plan.stdout
    again = keel(tmp_path, "run", "EXP")
    assert again.returncode == 0 and "1 ran" in again.stdout, again.stdout + again.stderr
    assert output.read_text() == "1"


@pytest.mark.parametrize("text, said", [
    ('{"state": "SUCCESS"}', "{status} is not a status keel wrote (missing attempt, started)"),
    ('{"state": "SUCCESS", "attempt": "1", "started": 0}', "{status} is not a status keel wrote (an attempt or start time"),
    ('{"state": "SUCCESS", "attempt": 1, "started": 0, "manifest": {"total_bytes": 0}}',
     "cache entry invalid: a manifest keel did not write"),
], ids=["fields missing", "attempt a string", "manifest without files"])
def test_a_status_of_the_wrong_shape_names_its_file_and_reruns(tmp_path, text, said):
    write_experiment(tmp_path, GOOD + MAIN)
    assert keel(tmp_path, "run", "EXP").returncode == 0
    [status] = (tmp_path / "out").glob("x/a-*/.keel/status")
    status.write_text(text)
    plan = keel(tmp_path, "plan", "EXP")
    assert plan.returncode == 0 and "Traceback" not in plan.stderr, plan.stderr
    assert said.format(status=status) in plan.stdout, plan.stdout
    again = keel(tmp_path, "run", "EXP")
    assert again.returncode == 0 and "1 ran" in again.stdout, again.stdout + again.stderr


@pytest.mark.parametrize("data, why", [
    (os.urandom(20_000).replace(b"\x00", b"\x01"), "undecodable bytes or control characters"),
    ("text saved as UTF-16, which decodes as UTF-8 with a NUL byte after each letter\n".encode("utf-16-le"), "contains NUL bytes"),
], ids=["random bytes", "utf-16 text"])
def test_binary_data_saved_as_text_is_not_a_document(tmp_path, data, why):
    (tmp_path / "noise.txt").write_bytes(data)
    write_experiment(tmp_path, 'from defaults import ingest\nb = ingest("noise", ("noise.txt",))\n' + MAIN)
    result = keel(tmp_path, "run", "EXP")
    assert_failed(result, "not text (binary data)")
    assert why in result.stdout + result.stderr


def test_two_inputs_whose_documents_would_share_ids_are_refused_before_anything_runs(tmp_path):
    for year in ("2023", "2024"):
        (tmp_path / year).mkdir()
        (tmp_path / year / "notes.txt").write_text(f"the notes of {year}\n")
    write_experiment(tmp_path, 'from defaults import ingest\nb = ingest("notes", ("2023/notes.txt", "2024/notes.txt"))\n' + MAIN)
    result = keel(tmp_path, "run", "EXP")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "2023/notes.txt and" in result.stderr and "both give documents the ids 'notes.txt:N'" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_a_tuple_written_as_a_set_value_parses_like_a_list(tmp_path):
    write_experiment(tmp_path, GOOD + MAIN)
    with_tuple, with_list = (keel(tmp_path, "plan", "EXP", "--json", "--set", f"x/b.inputs={v}") for v in ("()", "[]"))
    assert with_tuple.returncode == 0, with_tuple.stderr
    assert json.loads(with_tuple.stdout)["steps"] == json.loads(with_list.stdout)["steps"]


def test_plan_only_lists_what_run_only_looks_at(tmp_path):
    write_experiment(tmp_path, GOOD + 'c = Step("x/c", write, C(3))\nif __name__ == "__main__":\n    main([b, c])\n')
    plan = keel(tmp_path, "plan", "EXP", "--only", "x/b")
    assert "x/a" in plan.stdout and "x/b" in plan.stdout and "x/c" not in plan.stdout, plan.stdout


def test_gc_keeps_outputs_made_with_set(tmp_path):
    write_experiment(tmp_path, GOOD + MAIN)
    assert keel(tmp_path, "run", "EXP", "--set", "x/a.n=5").returncode == 0
    listed = keel(tmp_path, "gc", "EXP", "--yes")
    assert listed.returncode == 0 and "made with --set x/a.n=5" in listed.stdout, listed.stdout + listed.stderr
    assert "0 unreached output(s)" in listed.stdout
    assert len(list((tmp_path / "out").glob("x/*-*"))) == 2  # x/a and x/b made with --set, kept
    assert keel(tmp_path, "gc", "EXP", "--set", "x/a.n=5").stdout.count("kept") == 0  # the same --set reaches them


def test_the_resume_hint_repeats_prefix_and_set(tmp_path):
    write_experiment(tmp_path, '''
import time
from keel.executor import interrupt


def slow(config):
    write(config)
    open(os.path.join(config.output_path, "started"), "w").write("yes")
    while not interrupt.requested():
        time.sleep(0.05)
    raise interrupt.StepInterrupted("stopped on request")


b = Step("x/slow", slow, C(1))
''' + MAIN)
    args = [sys.executable, "-m", "keel.cli_entry", "run", str(tmp_path / "exp.py"), "--prefix", str(tmp_path / "elsewhere"),
            "--set", "x/slow.n=2"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "elsewhere").glob("x/slow-*/started")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the step never started"
            time.sleep(0.05)
        proc.send_signal(2)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert f"--prefix {tmp_path / 'elsewhere'} --set x/slow.n=2) to resume" in err, err


def test_a_full_disk_is_a_failed_step_with_the_fix(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        write_experiment(tmp_path, 'def big(config):\n    os.makedirs(config.output_path, exist_ok=True)\n'
                                   '    open(os.path.join(config.output_path, "big.bin"), "wb").write(os.urandom(1 << 20))\n'
                                   'b = Step("x/big", big, C(1))\n' + MAIN)
        result = keel(tmp_path, "run", "EXP", "--prefix", str(disk))
        assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
        assert "No space left on device" in result.stderr and "free space there or pass another --prefix" in result.stderr, result.stderr
        assert not [p for p in disk.rglob("*") if ".tmp-" in p.name], "no temporary files left behind"
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_plan_says_when_a_cached_steps_function_changed(tmp_path):
    write_experiment(tmp_path, GOOD + MAIN)
    assert keel(tmp_path, "run", "EXP").returncode == 0
    path = tmp_path / "exp.py"
    path.write_text(path.read_text().replace("        f.write(str(config.n))", "        f.write(str(config.n))  # fixed"))
    plan = keel(tmp_path, "plan", "EXP")
    assert plan.returncode == 0 and "write changed since this output was made" in plan.stdout, plan.stdout
    assert "2 cached" in plan.stdout  # still cached: the code is not part of the identity


def test_force_starts_clean(tmp_path):
    write_experiment(tmp_path, GOOD + MAIN)
    assert keel(tmp_path, "run", "EXP").returncode == 0
    [output] = (tmp_path / "out").glob("x/a-*")
    (output / "checkpoints").mkdir()
    (output / "checkpoints" / "step-3").write_text("torn")  # what a rerun would otherwise resume from
    forced = keel(tmp_path, "run", "EXP", "--force", "^x/a$")
    assert forced.returncode == 0 and "1 ran" in forced.stdout, forced.stdout + forced.stderr
    assert not (output / "checkpoints").exists() and (output / "n.txt").read_text() == "1"


def test_records_of_the_wrong_shape_neither_block_plan_nor_run(tmp_path):
    write_experiment(tmp_path, GOOD + 'c = Step("x/c", write, C(3))\nif __name__ == "__main__":\n    main([b, c])\n')
    assert keel(tmp_path, "run", "EXP").returncode == 0
    [record] = (tmp_path / "out").glob("x/a-*/.keel/step.json")
    record.write_text("[1, 2]")  # an earlier run's record, edited: plan cannot diff against it
    [running] = (tmp_path / "out").glob("x/c-*/.keel")
    (running / "status").unlink()  # an attempt that never ended ...
    (running / "lease-00000009").write_text('{"owner": 3}')  # ... holding a lease keel never wrote
    write_experiment(tmp_path, GOOD.replace("C(1)", "C(5)") + 'c = Step("x/c", write, C(3))\nif __name__ == "__main__":\n    main([b, c])\n')
    plan = keel(tmp_path, "plan", "EXP")
    assert plan.returncode == 0 and "Traceback" not in plan.stderr, plan.stderr
    again = keel(tmp_path, "run", "EXP")
    assert again.returncode == 0 and "3 ran" in again.stdout, again.stdout + again.stderr


def test_gc_with_set_keeps_what_the_file_declares(tmp_path):
    write_experiment(tmp_path, GOOD + MAIN)
    assert keel(tmp_path, "run", "EXP").returncode == 0
    declared = sorted((tmp_path / "out").glob("x/*-*"))
    listed = keel(tmp_path, "gc", "EXP", "--set", "x/a.n=5", "--yes")
    assert listed.returncode == 0 and "0 unreached output(s)" in listed.stdout, listed.stdout + listed.stderr
    assert sorted((tmp_path / "out").glob("x/*-*")) == declared and len(declared) == 2
