"""torch.autograd.gradcheck of a collective op on rank 0's inputs while the other ranks keep contributing fixed
inputs: before each forward, rank 0 broadcasts whether another forward follows, so every rank makes the same
collective calls."""
import torch
import torch.distributed as dist


def gradcheck_on_rank0(rank, op, inputs, **gradcheck_kwargs):
    """Rank 0: gradcheck of `op` at `inputs`; other ranks: call `op(*inputs)` once per rank-0 forward. True on
    ranks other than 0; gradcheck's result on rank 0."""
    flag = torch.zeros(1)

    def forward(*args):
        flag.fill_(1)
        dist.broadcast(flag, 0)
        return op(*args)

    if rank == 0:
        ok = torch.autograd.gradcheck(forward, tuple(t.requires_grad_() for t in inputs), **gradcheck_kwargs)
        flag.fill_(0)
        dist.broadcast(flag, 0)
        return ok
    while True:
        dist.broadcast(flag, 0)
        if flag.item() == 0:
            return True
        op(*inputs)
