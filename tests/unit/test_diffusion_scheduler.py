"""The diffusion scheduler's decisions, with a fake denoiser (no torch)."""

from diffusion_plugin.batcher.batch import RowOutput, StepOutput
from diffusion_plugin.batcher.request import SeqStatus
from diffusion_plugin.batcher.scheduler import Scheduler
from tests.unit.diffusion_fakes import EOS, C, FakeDenoiser
from tests.unit.diffusion_fakes import make_seq as _seq


def test_admission_only_at_block_boundaries_and_max_batch():
    s = Scheduler(max_batch=2, canvas_length=C)
    d = FakeDenoiser(s)
    for name in "abc":
        s.add(_seq(name))
    d.step()
    assert d.forwarded[-1] == ["a", "b"] and [w.seq_id for w in s.waiting] == ["c"]  # max_batch
    s.add(_seq("d"))
    d.step()
    assert "d" not in s.running and "c" not in s.running  # mid-block: nobody joins
    d.step()  # third step: a and b finish block 0 (3 steps)
    assert all(s.running[x].status is SeqStatus.BLOCK_DONE for x in "ab")
    d.step()  # boundary: a, b commit (encoder pass); still full, c waits
    assert d.encoded[-1] == ["a", "b"] and "c" not in s.running


def test_retirement_frees_a_slot_that_the_next_boundary_fills():
    s = Scheduler(max_batch=1, canvas_length=C)
    d = FakeDenoiser(s)
    s.add(_seq("a", max_tokens=4))
    s.add(_seq("b", max_tokens=4))
    finished = []
    for _ in range(3):
        finished += d.step()[1]
    assert [f.seq.seq_id for f in finished] == ["a"] and s.running == {}
    assert finished[0].seq.status is SeqStatus.FINISHED_LENGTH and finished[0].seq.output_ids == [7] * 4
    batch, _ = d.step()
    assert batch.admit == ["b"] and "a" in batch.free  # a's state is dropped, b joins


def test_early_converged_rows_are_not_forwarded_and_waiting_is_counted():
    s = Scheduler(max_batch=2, canvas_length=C)
    d = FakeDenoiser(s, converge={"fast": 1})
    s.add(_seq("fast", steps=4))
    s.add(_seq("slow", steps=4))
    for _ in range(4):
        d.step()
    assert d.forwarded[:4] == [["fast", "slow"], ["slow"], ["slow"], ["slow"]]
    assert s.stats.row_steps_waiting == 3 and s.stats.row_steps == 5


def test_row_boundaries_let_a_converged_row_move_on_and_admit_at_once():
    s = Scheduler(max_batch=2, canvas_length=C, row_boundaries=True)
    d = FakeDenoiser(s, converge={"fast": 1})
    s.add(_seq("fast", steps=4, max_tokens=4))
    s.add(_seq("slow", steps=4))
    s.add(_seq("late", steps=4))
    d.step()  # fast converges and finishes (4 tokens = max_tokens)
    batch, _ = d.step()
    assert batch.admit == ["late"] and batch.denoise == ["slow", "late"]
    assert s.stats.row_steps_waiting == 0


def test_cancellation_takes_effect_before_the_next_forward():
    s = Scheduler(max_batch=2, canvas_length=C)
    d = FakeDenoiser(s)
    s.add(_seq("a"))
    s.add(_seq("b"))
    d.step()
    s.abort("a")
    batch, finished = d.step()
    assert batch.denoise == ["b"] and [f.seq.seq_id for f in finished] == ["a"]
    assert finished[0].seq.status is SeqStatus.FINISHED_ABORTED and "a" in batch.free
    s.add(_seq("w"))
    s.abort("w")  # cancelling a waiting request removes it from the queue
    d.step()
    assert not s.waiting and s.stats.aborted == 2


def test_rows_of_an_aborted_sequence_are_skipped_not_crashed_on():
    s = Scheduler(max_batch=2, canvas_length=C)
    s.add(_seq("a"))
    s.schedule()
    s.abort("a")
    s.schedule()
    committed, finished = s.update(StepOutput(rows=[RowOutput("a", True, committed=[1] * C)]))
    assert committed == [] and finished == []


def test_a_failed_forward_fails_exactly_its_batch():
    s = Scheduler(max_batch=2, canvas_length=C)
    d = FakeDenoiser(s, fail_at=2)
    for name in "abc":
        s.add(_seq(name))
    d.step()
    _, finished = d.step()
    assert sorted(f.seq.seq_id for f in finished) == ["a", "b"]
    assert all(f.seq.status is SeqStatus.FINISHED_ERROR and f.seq.error == "boom" for f in finished)
    d.fail_at = None
    d.step()
    assert "c" in s.running  # the loop goes on serving the next request


def test_eos_ends_with_stop_and_max_tokens_truncates():
    s = Scheduler(max_batch=2, canvas_length=C)
    d = FakeDenoiser(s, blocks={"e": [5, EOS, 6, 6], "m": [1, 2, 3, 4]})
    s.add(_seq("e", max_tokens=10))
    s.add(_seq("m", max_tokens=6))
    finished = []
    for _ in range(8):
        finished += d.step()[1]
    by = {f.seq.seq_id: f.seq for f in finished}
    assert by["e"].status is SeqStatus.FINISHED_STOPPED and by["e"].output_ids == [5]
    assert by["m"].status is SeqStatus.FINISHED_LENGTH and by["m"].output_ids == [1, 2, 3, 4, 1, 2]
