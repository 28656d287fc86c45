"""Which data-parallel rank this process is, for RemoteMoE.step() (ApplyOptimizer with
num_ranks > 1: proto/moe.proto, client/python/README.md "Training with several ranks").

    ranks = DataParallelRanks.from_torch_distributed()   # None: one process (world size 1)
    client.apply_optimizer(layer, adamw=..., num_ranks=ranks.num_ranks, rank=ranks.rank,
                           step=s, run_id=ranks.run_id())

The run id tells the server which job's steps these are, so that a job started again (from a
checkpoint, counting its steps from 0 again) is not answered with the records of the last
one: rank 0 draws a fresh one per launch and broadcasts it over torch.distributed's default
group the first time it is needed (a collective: every rank must call it, as every rank calls
step()).
"""

import uuid

import torch


class DataParallelRanks:

    def __init__(self, num_ranks, rank, run_id=None):
        if num_ranks < 2 or not 0 <= rank < num_ranks:
            raise ValueError("data-parallel ranks: need num_ranks >= 2 and 0 <= rank < "
                             "num_ranks, got num_ranks=%r rank=%r" % (num_ranks, rank))
        self.num_ranks = num_ranks
        self.rank = rank
        self._run_id = run_id

    @classmethod
    def from_torch_distributed(cls):
        """The default process group's world size and rank; None outside torch.distributed or
        with a world of one process."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls(dist.get_world_size(), dist.get_rank())

    def run_id(self):
        if self._run_id is None:
            ids = [uuid.uuid4().hex if self.rank == 0 else None]
            torch.distributed.broadcast_object_list(ids, src=0)
            self._run_id = ids[0]
        return self._run_id
