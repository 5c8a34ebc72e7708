"""What the command lines print: --help in titled groups with real placeholders, each default
once and examples last (each of which parses); one spelling per pipeline schedule, with the
library's and any case accepted alike; a bad choice as one line naming the flag, the value and
the choices; the selftest's progress lines."""

import dataclasses
import io
import re
import shlex
import subprocess
import sys

import pytest

from overlap.plan.config import PlanConfig
from overlap.plan.config import build_parser as plan_parser
from overlap.plan.config import parse_args as plan_args
from overlap.pp import build_schedule
from overlap.selftest.config import build_parser as selftest_parser
from overlap.selftest.config import parse_args as selftest_args
from overlap.selftest.report import CheckResult
from overlap.train.config import TrainConfig
from overlap.train.config import build_parser as train_parser
from overlap.train.config import parse_args as train_args

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

PARSERS = {"overlap-train": train_parser, "overlap-plan": plan_parser,
           "overlap-selftest": selftest_parser}
PLAN = ["--model", "gpt3-175b", "--gpus", "512", "--tp", "8", "--pp", "8",
        "--global-batch", "1536"]


def _sections(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """Help text -> {section title: [(flag, placeholder or "", its whole help entry)]}."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    title = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            title = line[:-1]
            out[title] = []
        elif title and (m := re.match(r"^  (--[\w-]+)(?:,? (\S+))?", line)):
            out[title].append((m[1], m[2] or "", line))
        elif title and out[title] and line.startswith("    "):
            flag, meta, entry = out[title][-1]
            out[title][-1] = (flag, meta, entry + " " + line.strip())
    return out


def test_train_help_groups_its_flags():
    sections = _sections(train_parser().format_help())
    where = {flag: title for title, rows in sections.items() for flag, _, _ in rows}
    assert {"model", "data", "optimizer", "memory", "checkpoints and faults",
            "checks and profiling", "MoE (mixture of experts)",
            "CP (context parallelism)"} <= set(sections)
    layout = next(t for t in sections if t.startswith("layout"))
    assert [f for f, _, _ in sections[layout]][:3] == ["--tp", "--pp", "--dp"]
    expected = {"--ep": "MoE (mixture of experts)", "--moe-experts": "MoE (mixture of experts)",
                "--cp-method": "CP (context parallelism)", "--lr": "optimizer",
                "--recompute": "memory", "--save": "checkpoints and faults",
                "--max-restarts": "checkpoints and faults", "--profile": "checks and profiling",
                "--schedule": layout, "--data": "data", "--n-layer": "model"}
    assert {flag: where[flag] for flag in expected} == expected
    assert "other options" not in sections  # every flag has its group
    hidden = {"--kill-rank", "--kill-at-step", "--kill-node"}
    assert set(where) == {"--" + f.name.replace("_", "-")
                          for f in dataclasses.fields(TrainConfig)} - hidden


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_defaults_once_and_real_placeholders(prog):
    text = PARSERS[prog]().format_help()
    assert text.startswith(f"usage: {prog} [options]\n")
    rows = [row for rows in _sections(text).values() for row in rows]
    assert len(rows) >= 8
    for flag, meta, entry in rows:
        assert entry.count("(default") <= 1, entry
        assert meta != flag[2:].upper().replace("-", "_"), entry
    assert "(default: None)" not in text


def _examples(text: str, prog: str) -> list[list[str]]:
    tail = text.split("\nexamples:\n", 1)[1].replace("\\\n", " ")
    return [shlex.split(line, comments=True)[1:] for line in tail.splitlines()
            if line.startswith(f"  {prog} ")]


def test_every_example_parses_and_validates():
    text = train_parser().format_help()
    train = _examples(text, "overlap-train")
    assert len(train) >= 8 and text.rstrip().endswith("in any case.")
    for argv in train:
        if "--resume" not in argv:  # needs a checkpoint on disk
            assert isinstance(train_args(argv), TrainConfig), argv
    plan = _examples(plan_parser().format_help(), "overlap-plan")
    assert len(plan) >= 5
    for argv in plan:
        assert isinstance(plan_args(argv), PlanConfig), argv
    selftest = _examples(selftest_parser().format_help(), "overlap-selftest")
    assert len(selftest) >= 3
    for argv in selftest:
        selftest_args(argv)


SPELLINGS = {"gpipe": ("gpipe", "GPipe", "GPIPE"), "1f1b": ("1f1b", "1F1B"),
             "interleaved": ("interleaved", "interleaved_1f1b", "Interleaved-1F1B",
                             "INTERLEAVED"),
             "zb-h1": ("zb-h1", "zb_h1", "ZB_H1", "Zb-H1")}
LIBRARY_KEY = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b",
               "zb-h1": "zb_h1"}


@pytest.mark.parametrize("canonical", sorted(SPELLINGS))
def test_every_schedule_spelling_means_the_same(canonical):
    virtual = 2 if canonical == "interleaved" else 1
    want = build_schedule(LIBRARY_KEY[canonical], pp_size=2, num_microbatches=4,
                          num_virtual=virtual)
    for name in SPELLINGS[canonical]:
        assert train_args(["--schedule", name]).schedule == canonical, name
        assert plan_args(PLAN + ["--schedule", name]).schedule == canonical, name
        got = build_schedule(name, pp_size=2, num_microbatches=4, num_virtual=virtual)
        assert got == want and got.name == LIBRARY_KEY[canonical], name
        # a config built in code holds the same value as the CLI's, so the job, checkpoints
        # and the planner read one spelling
        assert TrainConfig(schedule=name).schedule == canonical, name


def test_a_config_built_in_code_with_no_schedule_is_refused_by_name():
    from overlap.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"--schedule must be one of gpipe, 1f1b, interleaved, "
                                          r"zb-h1 \(or interleaved_1f1b, zb_h1\), got 'zb-h2'"):
        TrainConfig(schedule="zb-h2").validate()


def test_build_schedule_names_every_spelling_when_unknown():
    with pytest.raises(ValueError, match=r"unknown schedule 'zb-h2'; expected one of "
                                         r"\['gpipe', '1f1b', 'interleaved', 'zb-h1'\]"):
        build_schedule("zb-h2", pp_size=2, num_microbatches=4)


@pytest.mark.parametrize("module, flag, value, choices", [
    ("overlap.train", "--schedule", "foo", ("gpipe", "1f1b", "interleaved", "zb-h1",
                                            "interleaved_1f1b", "zb_h1")),
    ("overlap.train", "--cp-method", "foo", ("ring", "allgather", "ulysses", "auto")),
    ("overlap.plan", "--schedule", "pipedream", ("gpipe", "1f1b", "interleaved", "zb-h1")),
    ("overlap.plan", "--zero", "7", ("0", "1", "2", "3")),
    ("overlap.selftest", "--device", "tpu", ("auto", "cpu", "cuda")),
    ("overlap.profile.analyze", "--progress", "sometimes", ("auto", "on", "off")),
])
def test_a_bad_choice_is_one_line(module, flag, value, choices):
    proc = subprocess.run([sys.executable, "-m", module, flag, value], capture_output=True,
                          text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert proc.stdout == ""
    line = lines[0]
    assert re.search(rf"argument {flag}: invalid choice: '?{value}'? \(choose from", line), line
    assert all(re.search(rf"\b{re.escape(c)}\b", line.split("choose from", 1)[1])
               for c in choices), line


@pytest.mark.parametrize("argv, needle", [
    (["--tp", "two"], "argument --tp: invalid int value: 'two'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_other_parse_errors_are_one_line_with_a_hint(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        train_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err == f"overlap-train: error: {needle} (see overlap-train --help)\n"


def test_plan_help_says_where_its_defaults_differ_from_the_main_job():
    from overlap.plan.config import TRAIN_DEFAULTS

    rows = {flag: entry for rows in _sections(plan_parser().format_help()).values()
            for flag, _, entry in rows}
    train = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    plan = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    assert {"sequence_parallel", "recompute", "comm_dtype", "gpu"} <= set(TRAIN_DEFAULTS)
    for mine, (theirs, default) in TRAIN_DEFAULTS.items():
        assert train[theirs] == default != plan[mine], (mine, theirs)
    assert "overlap-train's --recompute defaults to none" in rows["--recompute"]
    assert "overlap-train's --comm-dtype defaults to fp32" in rows["--comm-dtype"]
    assert "overlap-train's --plan-profile defaults to h100-sxm" in rows["--gpu"]
    assert ("overlap-train's --sequence-parallel defaults to on"
            in rows["--sequence-parallel"])
    assert "overlap-train" not in rows["--schedule"]  # the same default: no note
    text = plan_parser().format_help()
    assert "a 3D layout" not in text and "tp x cp x pp x dp" in " ".join(text.split())


def _result(name, passed=True, seconds=0.012, error=""):
    return CheckResult(name=name, passed=passed, seconds=seconds, metric="", measured=None,
                       limit=None, error=error, detail="")


def test_progress_in_a_log_is_one_plain_line_per_check():
    from overlap.selftest.report import Progress

    out = io.StringIO()
    p = Progress(10, out)
    p(_result("tp.a"))
    p(_result("pp.b", passed=False, seconds=12.5, error="rank 1: rel err 3 exceeds 1e-05"))
    p.close()
    assert out.getvalue() == ("[ 1/10] tp.a  pass  12 ms\n"
                              "[ 2/10] pp.b  FAIL  12.5 s  rank 1: rel err 3 exceeds 1e-05\n")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_rewrites_one_line_and_keeps_failures():
    from overlap.selftest.report import Progress

    out = _Terminal()
    p = Progress(3, out)
    p(_result("tp.a"))
    p(_result("pp.b", passed=False, error="boom"))
    p(_result("ep.c"))
    p.close()
    assert out.getvalue() == ("\r\x1b[K[1/3] tp.a  pass  12 ms"
                              "\r\x1b[K[2/3] pp.b  FAIL  12 ms  boom\n"
                              "\r\x1b[K[3/3] ep.c  pass  12 ms"
                              "\r\x1b[K")
