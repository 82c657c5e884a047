"""A new user's first hour (issue 16): mistakes end in one line that says what to do, with a
distinct exit code, and the reader recognises the common ones."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.errors import CheckpointError
from tests import clirun
from tests.disk import flip_byte

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args):
    """The command, run in this process (``tests/clirun.py``)."""
    return clirun.cli(*args)


def _one_line_error(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    for step in (7, 8):
        dcp.save({"w": torch.randn(64, 64), "step": step, "lr": 1e-3},
                 storage_writer=DataStatesWriter(str(run / f"step-{step}")), no_dist=True)
    return run


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save({"w": torch.randn(8)}, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    return d


@pytest.mark.parametrize("cmd", [["verify"], ["inspect"], ["convert", "--to", "dcp"]])
def test_missing_path_is_not_found_not_damaged(tmp_path, cmd):
    args = [cmd[0], str(tmp_path / "typo")] + ([str(tmp_path / "out")] + cmd[1:] if cmd[0] == "convert" else [])
    _one_line_error(cli(*args), 3, "does not exist")


def test_verify_run_directory_checks_every_step(run_dir):
    r = cli("verify", str(run_dir))
    assert r.returncode == 0 and "step-7" in r.stdout and "step-8" in r.stdout, r.stdout + r.stderr


def test_dcp_checkpoint_is_named_as_such(dcp_dir):
    _one_line_error(cli("verify", str(dcp_dir)), 5, "DCP's own format", "FileSystemReader")
    with pytest.raises(BaseException) as ei:
        dcp.load({"w": torch.zeros(8)}, storage_reader=DataStatesReader(str(dcp_dir)), no_dist=True)
    assert "DCP's own format" in str(ei.value) and "convert" in str(ei.value)


def test_run_directory_given_to_the_reader_lists_its_steps(run_dir):
    with pytest.raises(BaseException) as ei:
        dcp.load({"w": torch.zeros(64, 64)}, storage_reader=DataStatesReader(str(run_dir)), no_dist=True)
    text = str(ei.value)
    assert "run directory" in text and "step-7" in text and "step-8" in text
    _one_line_error(cli("inspect", str(run_dir / "step-9")), 3)


def test_purged_step_is_explained(tmp_path):
    run = tmp_path / "run"
    c = Checkpointer([str(run)], async_mode=None, incremental=True, keep=1)
    w = torch.randn(512, 1024)  # 2 MiB: shared by later steps
    for step in (1, 2):
        c.save(step, {"w": w, "b": torch.randn(4)})
    c.close()
    assert (run / "step-1" / ".purged").exists()  # a husk: later steps use its bytes
    _one_line_error(cli("verify", str(run / "step-1")), 4, "purged")
    r = cli("verify", str(run))
    assert r.returncode == 0 and "step-2" in r.stdout and "step-1" not in r.stdout, r.stdout


def test_dtype_mismatch_warns(tmp_path, caplog):
    path = str(tmp_path / "c")
    dcp.save({"w": torch.randn(16)}, storage_writer=DataStatesWriter(path), no_dist=True)
    out = {"w": torch.zeros(16, dtype=torch.bfloat16)}
    with caplog.at_level(logging.WARNING, logger="dcp_datastates.load.reader"):
        dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    assert any("saved as float32" in r.message and "bfloat16" in r.message for r in caplog.records)


def test_one_fallback_warning_per_file(tmp_path, caplog):
    fast, slow = str(tmp_path / "fast" / "step-1"), str(tmp_path / "slow" / "step-1")
    sd = {f"t{i}": torch.randn(1024) for i in range(16)}
    w = DataStatesWriter(fast, persist_to=[slow])
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.wait_persisted(60)
    for n in os.listdir(fast):
        if n.endswith(".dsd"):
            os.remove(os.path.join(fast, n))
    out = {k: torch.zeros(1024) for k in sd}
    with caplog.at_level(logging.WARNING, logger="dcp_datastates.load.reader"):
        dcp.load(out, storage_reader=DataStatesReader(fast, fallback=[slow]), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    fallbacks = [r for r in caplog.records if "instead" in r.message]
    assert len(fallbacks) == 1, [r.message for r in fallbacks]


def test_sizes_version_and_quiet_pipes(run_dir, tmp_path):
    r = cli("convert", str(run_dir / "step-7"), str(tmp_path / "st"), "--to", "safetensors",
            "--max-shard-bytes", "5GB")
    assert r.returncode == 0, r.stderr[-2000:]
    r = cli("convert", str(run_dir / "step-7"), str(tmp_path / "st2"), "--to", "safetensors",
            "--max-shard-bytes", "lots")
    assert r.returncode == 2 and "is not a size" in r.stderr and "Traceback" not in r.stderr
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("dcp-datastates ")
    p = subprocess.run(f"{sys.executable} -m dcp_datastates inspect {run_dir / 'step-7'} --json | head -1",
                       shell=True, capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.stdout.strip() == "{" and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr


def test_inspect_shows_scalars(run_dir):
    r = cli("inspect", str(run_dir / "step-7"))
    assert r.returncode == 0 and "= 7" in r.stdout and "= 0.001" in r.stdout, r.stdout


def test_process_mode_needs_a_process_group_at_construction(tmp_path):
    with pytest.raises(ValueError, match="initialized process group"):
        Checkpointer([str(tmp_path / "run")], async_mode="process")


def test_safetensors_export_is_a_directory_and_keeps_values(run_dir, tmp_path):
    from safetensors.torch import load_file
    out = tmp_path / "hf"
    r = cli("convert", str(run_dir / "step-7"), str(out), "--to", "safetensors")
    assert r.returncode == 0 and "left out 2 non-tensor value(s)" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(out)) == ["model.safetensors", "values.json"]
    import json
    assert json.load(open(out / "values.json")) == {"lr": 0.001, "step": 7}
    assert set(load_file(str(out / "model.safetensors"))) == {"w"}
    hf = str(tmp_path / "hf-src")
    dcp.save({"model": {"w": torch.randn(4), "b": torch.randn(2)}, "optim": {"m": torch.randn(4)}, "step": 3},
             storage_writer=DataStatesWriter(hf), no_dist=True)
    r = cli("convert", hf, str(tmp_path / "renamed"), "--to", "safetensors", "--keys", "model.*",
            "--strip-prefix", "model.")
    assert r.returncode == 0 and "left out" not in r.stdout, r.stdout + r.stderr
    assert set(load_file(str(tmp_path / "renamed" / "model.safetensors"))) == {"w", "b"}


def test_convert_streams_in_bounded_memory(tmp_path):
    """convert holds one batch of tensors, never the whole state: 256 MiB of state converted
    with 16 MiB batches grows anonymous memory by under half the state (measured alone: 40, 32
    and 17 MiB, up to 96 MiB inside the full suite; reading it all took 256+), in each direction,
    and the result is bit-exact."""
    state = {"model": {f"w{i}": torch.randn(2 << 20) for i in range(32)}, "step": 5}  # 32 x 8 MiB
    total = 32 * (8 << 20)
    src = str(tmp_path / "src")
    dcp.save(state, storage_writer=DataStatesWriter(src), no_dist=True)
    runs = {"dcp": (src, str(tmp_path / "as-dcp")), "safetensors": (src, str(tmp_path / "st")),
            "datastates": (str(tmp_path / "as-dcp"), str(tmp_path / "back"))}
    for direction, (a, b) in runs.items():
        r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "convert_child.py"), direction, a, b,
                            str(16 << 20)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        assert r.returncode == 0, r.stderr[-3000:]
        out = __import__("json").loads(r.stdout.strip().splitlines()[-1])
        assert out["growth"] < total // 2, (direction, out)
        assert out["progress"] == [total, total] and out["calls"] >= 2, (direction, out)
    back = {"model": {f"w{i}": torch.empty(2 << 20) for i in range(32)}, "step": 0}
    dcp.load(back, storage_reader=DataStatesReader(str(tmp_path / "back")), no_dist=True)
    assert back["step"] == 5 and all(torch.equal(back["model"][k], state["model"][k]) for k in back["model"])
    assert not os.path.exists(str(tmp_path / "back") + ".convert-scratch")


def test_a_checkpointer_given_one_path_as_a_string_saves_there(tmp_path, monkeypatch):
    """``Checkpointer("/ckpt/run")`` (one tier, not a list): before, each character of the
    path was a tier, and the first save claimed ``/step-1`` at the file system's root."""
    monkeypatch.chdir(tmp_path)  # were a character a tier, its steps would land here, not at /
    run = str(tmp_path / "run")
    ck = Checkpointer(run, async_mode=None)
    assert ck.tiers == [run]
    ck.save(1, {"w": torch.ones(4)})
    assert os.path.exists(os.path.join(run, "step-1", ".metadata"))
    out = {"w": torch.zeros(4)}
    assert ck.load(out) == 1 and torch.equal(out["w"], torch.ones(4))
    ck.close()


@pytest.mark.parametrize("kw,said", [({"compresion": "zstd"}, "did you mean 'compression'"),
                                     ({"kep": 2}, "did you mean 'keep'"),
                                     ({"repicas": 1}, "did you mean 'replicas'"),
                                     ({"compression": "zstdd"}, "compression")])
def test_a_misspelled_or_bad_checkpointer_option_fails_at_construction(tmp_path, kw, said):
    """Before: accepted, and training died at the first save with DataStatesWriter's TypeError."""
    with pytest.raises(ValueError, match="Checkpointer") as ei:
        Checkpointer([str(tmp_path / "run")], async_mode=None, **kw)
    assert said in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


def test_loading_a_run_that_is_not_there_says_so(tmp_path, caplog):
    """A mistyped run directory: ``load`` returns None (a fresh start) with one line saying there
    is no such directory, instead of starting from step 0 without a word."""
    ck = Checkpointer([str(tmp_path / "rnu")], async_mode=None)  # the run is at tmp_path/run
    with caplog.at_level(logging.WARNING, logger="dcp_datastates"):
        assert ck.load({"w": torch.zeros(4)}) is None
    said = [r.getMessage() for r in caplog.records if "starts afresh" in r.getMessage()]
    assert len(said) == 1 and "no directory at" in said[0] and "rnu" in said[0], said
    ck.close()


def test_verify_of_a_run_of_dcp_steps_says_they_are_dcps_own(tmp_path):
    """Before: each step 'DAMAGED', exit 1."""
    for step in (1, 2):
        dcp.save({"w": torch.ones(4) * step}, storage_writer=dcp.FileSystemWriter(str(tmp_path / f"step-{step}")),
                 no_dist=True)
    _one_line_error(cli("verify", str(tmp_path)), 5, "DCP's own format", "every step")


def test_verify_of_a_directory_with_nothing_of_ours_says_so(tmp_path):
    """Before: 'a save that never committed (it was interrupted ...)'."""
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "sub").mkdir()
    _one_line_error(cli("verify", str(tmp_path)), 4, "none of its 2 entries", "mistyped")


def test_a_safetensors_export_of_a_damaged_checkpoint_leaves_nothing_behind(tmp_path):
    """Before: the export failed on the damaged tensor and left ``values.json`` behind."""
    ck = tmp_path / "ck"
    dcp.save({"w": torch.randn(256, 256), "step": 3}, storage_writer=DataStatesWriter(str(ck)), no_dist=True)
    data = next(p for p in ck.iterdir() if p.name.startswith("data-"))
    flip_byte(data, data.stat().st_size // 2)
    out = tmp_path / "st"
    r = cli("convert", str(ck), str(out), "--to", "safetensors")
    assert r.returncode != 0 and "checksum" in r.stderr, r.stderr
    assert not out.exists() or not list(out.iterdir()), list(out.iterdir())


def test_loading_a_step_that_is_not_committed_fails(tmp_path):
    """``load(state, step=N)`` is a resume the caller asked for: a step that is not there is an
    error, not a silent fresh start (None)."""
    ck = Checkpointer([str(tmp_path / "run")], async_mode=None)
    ck.save(1, {"w": torch.ones(4)})
    with pytest.raises(CheckpointError, match=r"step 5 is not committed .*committed: \[1\]"):
        ck.load({"w": torch.zeros(4)}, step=5)
    assert ck.load({"w": torch.zeros(4)}, step=1) == 1
    ck.close()


def test_a_save_says_what_it_cost_and_a_long_load_how_far_it_is(tmp_path, caplog, monkeypatch):
    from dcp_datastates.load import reads
    monkeypatch.setattr(reads, "PROGRESS_S", 0.0)
    ck = Checkpointer([str(tmp_path / "run")])
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        ck.save(1, {f"w{i}": torch.randn(1 << 20) for i in range(8)})
        ck.wait()
        ck.load({f"w{i}": torch.zeros(1 << 20) for i in range(8)})
    said = [r.getMessage() for r in caplog.records]
    assert any("committed" in m and "s from the save call" in m and "MiB/s" in m for m in said), said
    assert any("GiB read" in m for m in said), said
    ck.close()


def test_the_demo_removes_its_checkpoints_and_says_so(tmp_path, monkeypatch):
    """Before: every ``make demo`` left about 1 GB in the temp directory without a word."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the demo's process makes its directory there
    r = clirun.cli_process("demo", "--width", "256", "--depth", "2", "--steps", "8", "--kill-at", "5")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "removed the demo's checkpoints" in r.stdout, r.stdout
    (base,) = [p for p in tmp_path.iterdir() if p.name.startswith("dcpds-demo-")]
    left = [p for p in base.rglob("*") if p.is_file()]
    assert left and all(p.suffix in (".png", ".svg") for p in left), left
