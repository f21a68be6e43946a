"""A probe, not a feature: with PROBE_INT8 set, every process that starts with this folder on
PYTHONPATH runs the encoder's linears through torch's dynamic int8 linear (fbgemm: weights int8
per output, each input quantized on the fly) instead of the float32 packed ones. It measured
whether an int8 encoder is worth building for CPUs without AVX-512 (docs/benchmarks.md,
"int8 encoder linears on AVX2"):

    PYTHONPATH=benchmarks/probes PROBE_INT8=1 python benchmarks/long_form.py --models tiny.en \
        --sets real-en,espeak-en --systems asrserve-auto-seek

PROBE_INT8=1 quantizes activations to 7 bits (fbgemm's reduce_range: AVX2's VPMADDUBSW cannot
saturate), PROBE_INT8=full to 8 bits. torch deprecates these quantized tensors, so a build
would need a kernel of its own."""
import os

if os.environ.get("PROBE_INT8"):
    import torch
    from torch import nn
    import asrserve.worker.model_runner as mr
    original = mr.pack_linears
    reduce_range = os.environ["PROBE_INT8"] != "full"

    class DynInt8(nn.Module):
        def __init__(self, linear):
            super().__init__()
            w = linear.weight.detach().float()
            scale = (w.abs().amax(1) / 127).clamp_min(1e-8)
            q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
            bias = linear.bias.detach().float() if linear.bias is not None else None
            self.packed = torch.ops.quantized.linear_prepack(q, bias)
            self.out_features = w.shape[0]

        def forward(self, x):
            shape = x.shape
            out = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).contiguous(), self.packed, reduce_range)
            return out.view(*shape[:-1], self.out_features)

    def patched(module):
        if type(module).__name__.endswith("Encoder"):
            for name, m in [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]:
                module.set_submodule(name, DynInt8(m))
            print("PROBE: encoder linears in dynamic int8, reduce_range", reduce_range, flush=True)
            return True
        return original(module)

    mr.pack_linears = patched
