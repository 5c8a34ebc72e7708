import torch
import torch.distributed as dist

from overlap.dist.launch import launch
from overlap.models import GPT, GPTConfig, gpt_loss
from overlap.pp import Pipeline, build_schedule, pipeline_stages


def main(schedule, virtual):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=4, n_head=2))
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
    pp_group = dist.group.WORLD
    stages = pipeline_stages(model, pp_group=pp_group, num_virtual=virtual)  # this rank's chunks
    sched = build_schedule(schedule, pp_size=pp_group.size(), num_microbatches=4,
                           num_virtual=virtual)
    pipe = Pipeline(stages, sched, loss_fn=gpt_loss, pp_group=pp_group, timeout=60)
    out = pipe.step(idx, targets)   # idx on the rank with stage 0, targets on the last stage's
    pipe.close()
    mine = {id(p) for s in stages for p in s.module.parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if id(p) in mine}
    model.zero_grad()
    ref_loss = 0.0
    for x, y in zip(idx.chunk(4), targets.chunk(4)):          # the unsplit reference
        loss = gpt_loss(model(x), y) / 4
        loss.backward()
        ref_loss += loss.item()
    grad_err = max((grads[n] - p.grad).abs().max().item()
                   for n, p in model.named_parameters() if n in grads)
    loss_err = 0.0 if out.loss is None else abs(out.loss.item() - ref_loss)   # last stage only
    return loss_err, grad_err


if __name__ == "__main__":
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        out = launch(main, 2, args=(schedule, virtual))
        print(schedule, out)      # per rank: |loss - reference|, max |grad - reference|
        assert all(l_err < 1e-5 and g_err < 1e-5 for l_err, g_err in out), out
