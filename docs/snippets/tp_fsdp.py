import copy

import torch
import transformers as T
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from overlap.dist.launch import launch
from overlap.nn import expose_dtensors, parallelize
from overlap.tp import TPComm


def main():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))   # "cuda" on GPUs
    comm = TPComm(mesh["tp"].get_group())                                  # collective
    parallelize(model, comm=comm)
    expose_dtensors(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    comm.close()
    return all(torch.equal(full[k], v) for k, v in reference.state_dict().items())


if __name__ == "__main__":
    out = launch(main, 4)
    print(out)                                # [True, True, True, True]: global shapes, bit for bit
    assert all(out), out
