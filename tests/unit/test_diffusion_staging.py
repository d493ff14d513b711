"""A step's numbers onto its device in one copy (``diffusion_plugin.step.staging``): the values
``torch.tensor`` would make, all views of one buffer; and the fast step makes no tensor from
Python numbers outside it (on a device each such tensor is a copy that waits for the stream,
stalling the host between the step's kernels)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffusion_plugin.families.diffusiongemma import DiffusionGemmaAdapter
from diffusion_plugin.step.staging import stage
from tandem_tools.bench.opcount import HOST_TENSOR
from tandem_tools.bench.step_driver import Steps
from workers import tiny_models

CPU = torch.device("cpu")


def test_staged_numbers_are_the_ones_torch_tensor_makes_in_one_buffer():
    floats = [0.1, 1 / 3, 1e-40, -2.5e38, 7.0]  # (a float32 subnormal, a rounding, an exact value)
    arrays = {"i64": (torch.int64, [0, -1, 2**62, 12_345]), "i32": (torch.int32, [5, -7]),
              "f32": (torch.float32, floats), "f64": (torch.float64, floats),
              "table": (torch.long, [[3, 1, 0], [2, 0, 0]]), "column": (torch.float32, [[0.3], [0.6]]),
              "none": (torch.int64, [])}
    staged = stage(CPU, **arrays)
    for name, (dtype, values) in arrays.items():
        want = torch.tensor(values, dtype=dtype)
        assert staged[name].dtype == dtype and staged[name].shape == want.shape, name
        assert torch.equal(staged[name], want), (name, staged[name], want)
    assert len({t.untyped_storage().data_ptr() for t in staged.values()}) == 1  # one buffer, one copy
    assert all(t.data_ptr() % 64 == staged["i64"].data_ptr() % 64 for t in staged.values() if t.numel())
    assert stage(CPU) == {}


def test_rows_of_unequal_lengths_and_wrong_kinds_are_refused():
    with pytest.raises(ValueError, match="table: rows of unequal lengths"):
        stage(CPU, table=(torch.long, [[1, 2], [3], [4, 5, 6]]))
    with pytest.raises(TypeError):
        stage(CPU, ids=(torch.long, [1.5]))
    with pytest.raises(OverflowError):
        stage(CPU, starts=(torch.int32, [2**31]))


class _Made(TorchDispatchMode):
    """Counts the tensors made from Python numbers (``torch.tensor``)."""

    def __init__(self):
        super().__init__()
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.made += str(func.overloadpacket) == HOST_TENSOR
        return func(*args, **(kwargs or {}))


def _drive(compiled: bool, monkeypatch, rows: int, blocks: int, grow: int) -> Steps:
    """``rows`` fast rows of ``blocks`` blocks on the tiny model (eager, or the device form), their
    admissions (a prompt's ids, its new cache: before the step's first kernel) left out of any count."""
    from torch.utils._python_dispatch import _disable_current_modes

    torch.set_num_threads(1)
    adapter = DiffusionGemmaAdapter(str(tiny_models.build(tiny_models.TINY_DIFFUSIONGEMMA)))
    drive = Steps(adapter, rows, "fast", compiled=compiled, compiled_trunk=compiled,
                  batched_vocab=compiled or None, max_tokens=blocks * adapter.canvas_length, prompt_len=20, grow=grow)
    admit = drive.runner.admit

    def uncounted_admit(seq):
        with _disable_current_modes():
            admit(seq)

    monkeypatch.setattr(drive.runner, "admit", uncounted_admit)
    return drive


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "device-form"])
def test_a_fast_step_makes_no_tensor_from_host_numbers_after_its_admissions(compiled, monkeypatch):
    """Every step of two rows (prompts of one and two KV pages) through three blocks (prefills,
    denoise steps, commits with their next canvases): outside the admissions (a prompt's ids,
    its new cache: before the step's first kernel) no tensor is made from Python numbers; what
    the step reads arrives through ``stage``. (Before staging: six a denoise step.)"""
    drive = _drive(compiled, monkeypatch, 2, blocks=3, grow=70)
    kinds, steps = set(), 0
    while drive.sched.has_work() and steps < 400:
        batch, _ = drive.sched.schedule()
        if batch.empty():
            continue
        counter = _Made()
        with torch.inference_mode(), counter:
            drive.run(batch)
        steps += 1
        assert counter.made == 0, (steps, batch, counter.made)
        kinds |= {"admit"} if batch.admit else set()
        kinds |= {"commit"} if set(batch.encode) - set(batch.admit) else set()
        kinds |= {"denoise"} if batch.denoise else set()
    assert not drive.sched.has_work(), f"still running after {steps} steps"
    assert kinds == {"admit", "commit", "denoise"}, kinds


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "device-form"])
def test_label_reads_and_pinned_rows_share_the_steps_one_copy(compiled, monkeypatch):
    """A step with a label read (its own narrow canvas) beside generating rows, one of them with a
    seed canvas, pinned positions and logprobs: the step's numbers (both groups' starts, the pins
    of every row) still come from one ``stage`` call and no tensor is made from Python numbers;
    and the pinned positions hold their seed tokens in what the row commits."""
    from dataclasses import replace

    from diffusion_plugin.step import runner as runner_module

    drive = _drive(compiled, monkeypatch, 3, blocks=2, grow=40)
    pinned = drive.seqs["s1"]
    pinned.params = replace(pinned.params, seed_canvas=(5, 6, 7), pinned=(0, 2), logprobs=2)
    reader = drive.seqs["s2"]
    reader.params = replace(reader.params, max_tokens=0, max_denoising_steps=1)
    reader.read_ids = (10, 11, 12)
    calls = []

    def counted_stage(device, **arrays):
        calls.append(sorted(arrays))
        return stage(device, **arrays)

    monkeypatch.setattr(runner_module, "stage", counted_stage)
    mixed = steps = 0
    while drive.sched.has_work() and steps < 400:
        batch, _ = drive.sched.schedule()
        if batch.empty():
            continue
        counter, calls[:] = _Made(), []
        with torch.inference_mode(), counter:
            drive.run(batch)
        steps += 1
        assert counter.made == 0, (steps, batch, counter.made)
        if batch.denoise:
            numbers = [c for c in calls if "starts" in c or "read_starts" in c]
            assert len(numbers) == 1, (steps, calls)  # one copy a step, whatever its groups
            if "s2" in batch.denoise and len(batch.denoise) > 1:
                mixed += 1
                assert {"read_starts", "starts", "pin_rows", "pin_positions", "pin_tokens"} <= set(numbers[0])
    assert not drive.sched.has_work(), f"still running after {steps} steps"
    assert mixed == 1, mixed  # the read's one step, beside both generating rows
    assert len(reader.scores) == 3  # one score a read token
    assert pinned.output_ids[0] == 5 and pinned.output_ids[2] == 7
