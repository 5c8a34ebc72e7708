import torch
import torch.distributed as dist

from overlap.dist.launch import launch
from overlap.symm.workspace import create_workspace


def ring():
    group = dist.group.WORLD
    mine = torch.arange(256, dtype=torch.float32) + 1000 * dist.get_rank()
    with create_workspace(group, nbytes=1 << 20, num_signals=16, timeout=30) as ws:  # collective
        right, left = (ws.rank + 1) % ws.world, (ws.rank - 1) % ws.world
        ws.view(right, torch.float32, (256,)).copy_(mine)   # write into the peer's buffer
        ws.signal(right, slot=0, value=1)                   # release: payload before flag
        ws.wait(slot=0, value=1)                            # acquire: my left neighbour wrote
        received = ws.view(ws.rank, torch.float32, (256,)).clone()
        assert torch.equal(received, torch.arange(256, dtype=torch.float32) + 1000 * left)
        dist.barrier()                                      # nobody frees while others read
    return received[0].item()


if __name__ == "__main__":
    print(launch(ring, 4))                    # [3000.0, 0.0, 1000.0, 2000.0]
