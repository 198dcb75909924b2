"""A process whose scripted model's forked task still runs when Python exits ends cleanly (exit code 0):
the exit waits for torch's inter-op pool (``infer.artifact.pool_exit``) instead of aborting with
"terminate called without an active exception" when the task drops a tensor Python holds."""

import subprocess
import sys
import textwrap

import torch

from infer.artifact.pool_exit import drain_inter_op_pool

# The child's forked task multiplies a tensor Python holds ``rounds`` times, then drops it: without the
# drain, a task ending while the interpreter finalizes aborted the child about half the time at these
# sizes (measured here: 5 rounds, 3 of 6 runs; 20 rounds, 1 of 6), so several sizes run at once.
ROUNDS = (3, 5, 8, 12, 20)

CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from torch import Tensor
    from infer.artifact.formats.torchscript import script_model


    class ForkedWork(torch.nn.Module):
        def work(self, x: Tensor, rounds: int) -> Tensor:
            y = x
            for _ in range(rounds):
                y = torch.tanh(torch.mm(y, x))
            return y.sum()

        def forward(self, x: Tensor, rounds: int) -> torch.jit.Future[Tensor]:
            return torch.jit.fork(self.work, x, rounds)  # the caller exits without waiting


    model = script_model(ForkedWork())
    x = torch.randn(256, 256) / 16
    future = model(x, int(sys.argv[1]))
    """
)


def test_exit_waits_for_forked_tasks_holding_python_tensors(tmp_path):
    script = tmp_path / "forked_work.py"  # a file: TorchScript reads the module's source
    script.write_text(CHILD, encoding="utf-8")
    children = [
        subprocess.Popen([sys.executable, str(script), str(rounds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for rounds in ROUNDS
    ]
    for rounds, child in zip(ROUNDS, children):
        _, stderr = child.communicate()
        assert child.returncode == 0, f"{rounds} rounds: exit code {child.returncode}: {stderr.decode()[-2000:]}"
        assert b"terminate called" not in stderr


def test_drain_returns_once_every_inter_op_thread_met():
    """The drain runs one task per inter-op thread; twice in a row (the pool reused) works the same."""
    assert drain_inter_op_pool()
    assert drain_inter_op_pool()
    assert torch.get_num_interop_threads() >= 1
