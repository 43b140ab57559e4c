"""MoeLayer: one MoE layer of a Hugging Face GPTQ/AWQ checkpoint as a torch.nn.Module."""
import torch


class MoeLayer(torch.nn.Module):
    """One MoE block (router, routed experts, shared expert) on the wna16 library's backends.

    Built by :meth:`from_checkpoint` (the library's loader, weights packed once), or from a
    ``MoeWeights`` object returned by ``wna16.pack``. forward(x) takes [M, hidden] or
    [B, T, hidden] in bfloat16 or float16 (float32 is computed in bfloat16) and returns the same
    shape and dtype.
    """

    def __init__(self, weights):
        super().__init__()
        self.weights = weights
        self.hidden = weights.hidden()

    @classmethod
    def from_checkpoint(cls, path, layer, device="cpu"):
        """Layer ``layer`` of the model directory ``path`` (config.json + safetensors)."""
        device = str(torch.device(device).type) if not isinstance(device, str) else device
        return cls(torch.ops.wna16.load_checkpoint_layer(str(path), int(layer), device))

    def forward(self, x):
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"wna16.MoeLayer: x is {shape}; expected [M, {self.hidden}] or [B, T, {self.hidden}]")
        if x.shape[-1] != self.hidden:
            raise ValueError(f"wna16.MoeLayer: x has shape {list(x.shape)}; its last dimension must be the "
                             f"layer's hidden size {self.hidden}")
        y = torch.ops.wna16.moe_layer(x.reshape(-1, self.hidden), self.weights)
        return y.reshape(x.shape)

    def extra_repr(self):
        return self.weights.describe()
