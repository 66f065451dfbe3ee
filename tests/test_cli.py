"""`kvrestore demo` end to end on the real model, small enough for the suite."""

from __future__ import annotations

import argparse
import io
import itertools

import anyio
import pytest

from kvrestore.tools.cli import build_parser, main
from kvrestore.tools.demo import run_demo
from kvrestore.tools.progress import ProgressLog


@pytest.mark.model
@pytest.mark.slow
def test_demo_answers_with_every_policy(smollm2, tmp_path):
    out = io.StringIO()
    runs = anyio.run(
        lambda: run_demo(n_tokens=600, store_url=f"file://{tmp_path}", max_new_tokens=8, out=out)
    )
    text = out.getvalue()
    names = {r.name for r in runs}
    assert names - {n for n in names if n.startswith("auto: ")} == {
        "compute-only",
        "load-only",
        "two-pointer",
        "layer-wise",
    }
    assert len(names) == 5  # the planner ran once, and said what it chose
    assert "identical for every policy" in text
    by_name = {(r.name, r.store): r for r in runs}
    assert {store for _, store in by_name} == {
        "local disk",
        next(s for _, s in by_name if s.startswith("link")),
    }
    for (name, _), r in by_name.items():
        if name == "load-only":
            assert r.loaded == 3 and r.computed == 0
        elif name == "compute-only":
            assert r.computed == 3
        elif r.unit == "layers":
            assert r.computed + r.loaded == smollm2.spec.num_layers
        else:
            assert r.computed + r.loaded == 3
    assert all(r.answer for r in runs)


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--tokens", "0"])
    assert "--tokens must be positive" in capsys.readouterr().err


@pytest.mark.model
@pytest.mark.slow
def test_demo_replaces_unusable_chunks(smollm2, tmp_path):
    from pathlib import Path

    url = f"file://{tmp_path}"
    demo = lambda: run_demo(n_tokens=300, store_url=url, max_new_tokens=2, out=io.StringIO())  # noqa: E731
    anyio.run(demo)
    victim = sorted(Path(tmp_path).rglob("*.kvc"))[0]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x00")  # damage the last byte of one chunk
    local = lambda runs: {r.name: r for r in runs if r.store == "local disk"}  # noqa: E731
    runs = local(anyio.run(demo))
    assert runs["load-only"].failed_loads == 1  # found in its first round, recomputed and saved again
    assert sum(r.failed_loads for r in runs.values()) == 1
    runs = local(anyio.run(demo))  # the bad chunk was replaced
    assert sum(r.failed_loads for r in runs.values()) == 0
    assert runs["load-only"].computed == 0 and runs["load-only"].loaded == 2


@pytest.mark.model
@pytest.mark.slow
def test_bench_writes_its_json_and_plot(smollm2, tmp_path, capsys):
    import json

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["bench", "--tokens", "512", "--rounds", "1", "--multipliers", "1", "--json", str(out)]
    assert main([*args, "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    (point,) = result["grid"]
    assert point["multiplier"] == 1.0
    assert point["two_pointer_computed"] + point["two_pointer_loaded"] == 2
    assert point["oracle_s"] > 0 and point["two_pointer_s"] > 0
    assert result["targets"]["first_tokens_identical"]
    assert set(result["fluctuation"]) >= {"compute-only", "load-only", "two-pointer"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "two-pointer" in capsys.readouterr().out


def test_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--multipliers", "1,x"])
    assert "--multipliers" in capsys.readouterr().err


@pytest.mark.model
def test_profile_command_saves_a_profile_restorer_can_use(smollm2, tmp_path, capsys):
    from kvrestore import Restorer
    from kvrestore.costs.profile import Profile
    from kvrestore.stores.memory import MemoryStore

    out = tmp_path / "p.json"
    args = ["profile", "--max-tokens", "256", "--chunk-size", "128", "--repeats", "1"]
    assert main([*args, "--store", f"file://{tmp_path}/store", "--out", str(out)]) == 0
    said = capsys.readouterr()
    text = said.out
    assert "prefill n tokens" in text and f"saved {out}" in text
    assert len(said.err.splitlines()) >= 4  # progress on stderr: the model, then each measurement
    profile = Profile.load(out)
    assert profile.link is not None and profile.chunk.seconds(256) > 0
    assert Restorer(smollm2, MemoryStore(), profile=out).planner.profile == profile
    with pytest.raises(SystemExit):
        main(["profile", "--max-tokens", "0"])


def test_simulate_compares_the_schedulers_from_a_saved_profile(tmp_path, capsys):
    from kvrestore.costs.compute import ChunkCost

    from .test_profile import make_profile

    path = make_profile(chunk=ChunkCost(0.05, 1.4e-3, 7.6e-7, 3.8e-7)).save(tmp_path / "p.json")
    assert main(["simulate", "--profile", str(path), "--batch", "4", "--bandwidth", "2"]) == 0
    out = capsys.readouterr().out
    assert all(case in out for case in ("independent", "fifo", "batch-aware"))
    assert "4 restores arriving together" in out and "batch_lower_bound" in out
    assert main(["simulate", "--profile", str(path), "--rate", "0.5", "--duration", "40"]) == 0
    assert "Poisson at 0.5/s" in capsys.readouterr().out
    assert main(["simulate", "--profile", str(tmp_path / "missing.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", str(path), "--restore-share", "1.5"])
    assert "--restore-share" in capsys.readouterr().err


# -- the command line as people expect it -------------------------------------------------------------


def _commands(parser):
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_version(capsys):
    import re
    from pathlib import Path

    import kvrestore

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvrestore {kvrestore.__version__}"
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.+)"$', pyproject, re.M).group(1) == kvrestore.__version__


def test_every_command_and_option_has_help(capsys):
    parser = build_parser()
    commands = _commands(parser)
    assert set(commands) == {"demo", "bench", "profile", "simulate"}
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    for name, command in commands.items():
        assert name in top
        assert command.description  # `kvrestore NAME --help` says what it does
        for action in command._actions:
            assert action.help, f"kvrestore {name} {action.option_strings} has no help"
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0
        shown = capsys.readouterr().out
        assert all(opt in shown for a in command._actions for opt in a.option_strings)


def test_a_bad_store_url_stops_profile_before_the_model_loads(capsys, monkeypatch):
    from kvrestore.backends.hf import HFBackend

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(HFBackend, "from_smollm2", never)
    assert main(["profile", "--store", "memroy://"]) == 2
    assert "memory://" in capsys.readouterr().err  # the known schemes


def test_a_step_that_runs_long_says_so_until_it_ends():
    stream, now = io.StringIO(), [0.0]
    log = ProgressLog(stream, clock=lambda: now[0])
    log("measuring the prefill cost")
    now[0] = 12.0
    log.beat()
    assert stream.getvalue().splitlines()[-1] == "[  12.0s] ... measuring the prefill cost (12 s)"

    async def quiet_step():
        beats = lambda: stream.getvalue().count("...")  # noqa: E731
        async with log.beating(every_s=0.001, lines_every_s=5.0):
            with anyio.fail_after(60):
                while beats() < 3:  # the step says nothing while its clock runs: a line per 5 s
                    now[0] += 1.0
                    await anyio.sleep(0.001)
        seconds = [int(line.rsplit("(", 1)[1].split()[0]) for line in stream.getvalue().splitlines()[1:]]
        assert all(b - a >= 5 for a, b in itertools.pairwise(seconds))  # no more than a line per 5 s
        after = beats()
        now[0] += 100.0
        await anyio.sleep(0.01)
        assert beats() == after  # and stop with the block

    anyio.run(quiet_step)
