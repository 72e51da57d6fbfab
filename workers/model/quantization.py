"""WeightQuant: how a model's linear weights are held, from config.json's `quantization_config` and the
`quantization` option. Plain values, no torch: the scheme is read, and an unsupported one refused, before any
weight is read.

Two checkpoint formats are loaded, both FP8 e4m3 weights [N, K] beside fp32 scales that multiply them:
- compressed-tensors (`quant_method: "compressed-tensors"`, `format: "float-quantized"`, as llm-compressor
  writes it): `<linear>.weight_scale` per output channel [N, 1], per tensor [1], or per [128, 128] block
  (strategy "block"); activations dynamic per token, or static per tensor (`<linear>.input_scale`), or none
  (weights only: they are then quantized per token as well).
- transformers' fine-grained FP8 (`quant_method: "fp8"`, `weight_block_size: [128, 128]`, DeepSeek's layout):
  `<linear>.weight_scale_inv` [ceil(N/128), ceil(K/128)], dynamic activations.
Which linears are FP8 is read from the tensors themselves (an ignored module is stored in the model dtype).
A compressed-tensors `kv_cache_scheme` (K/V scales per layer, for an FP8 KV cache) loads with the KV cache in the
model dtype, where the scales are not needed, or, with `kv_cache_dtype="fp8"`, with the scales folded into each
layer's attention weights (kv_scales.py). Anything else under `quantization_config` (GPTQ, AWQ,
bitsandbytes, integer formats) is refused naming the field: its weights would otherwise load without their
scales and answer wrong tokens.

`quantization="fp8"` on a checkpoint in bf16/fp16/fp32 quantizes the linear weights at load, per output channel;
`quantization="int4"` (the CPU's) quantizes them to 4 bits in groups of 32 columns and the output head to int8
rows (kernels/int_weight.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mii_async.config import QUANTIZATIONS
from mii_async.errors import InvalidParameterError, UnsupportedModelError

BLOCK = 128                         # the block-wise scales' [BLOCK, BLOCK] tile
SCALE_STRATEGIES = ("channel", "tensor", "block")
FIELD = "quantization_config"


@dataclass(frozen=True)
class WeightQuant:
    method: str                     # "fp8" or "int4" (quantized at load), "compressed-tensors" or "fp8-block"
                                    # (transformers')
    scales: str                     # "channel": [N] a weight; "tensor": one a weight (kept per channel once
                                    # loaded); "block": one per [BLOCK, BLOCK] tile; "group": int4's groups
    scale_suffix: str = ""          # `<linear>.<suffix>` holds a checkpoint weight's scales; "" when quantized at load
    static_activations: bool = False    # the checkpoint holds `<linear>.input_scale`: activations quantized with
                                        # it rather than per token
    kv_scales: bool = False         # the checkpoint holds calibrated K/V scales (`kv_cache_scheme`), for an FP8
                                    # KV cache; with the cache in the model dtype they are not needed
    fold_kv_scales: bool = False    # the KV cache is e4m3: the K/V scales fold into each layer's attention
                                    # weights as it loads (kv_scales.py)

    @property
    def at_load(self) -> bool:
        """The checkpoint is in a float dtype and the linears are quantized as they load."""
        return self.method in ("fp8", "int4")

    @property
    def integer(self) -> bool:
        """The CPU's weight-only integer scheme (int4 projections, int8 head)."""
        return self.method == "int4"


AT_LOAD = {"fp8": WeightQuant("fp8", "channel"), "int4": WeightQuant("int4", "group")}


def weight_quantization(cfg: dict[str, Any], requested: str | None) -> WeightQuant | None:
    """The scheme a model loads with: the checkpoint's (`quantization_config`), else the requested one, else None
    (weights in the model dtype). Raises UnsupportedModelError naming the field for a quantization_config this
    engine does not load, and InvalidParameterError naming `quantization` for an unknown option."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise InvalidParameterError("quantization", f"must be one of {', '.join(QUANTIZATIONS)} or None, "
                                    f"got {requested!r}")
    held = checkpoint_quantization(cfg)
    if held is not None:
        if requested == "int4":
            raise InvalidParameterError("quantization", f"int4 quantizes float weights at load; this checkpoint is "
                                        f"already quantized ({held.method})")
        return held
    return AT_LOAD[requested] if requested is not None else None


def checkpoint_quantization(cfg: dict[str, Any]) -> WeightQuant | None:
    """config.json's `quantization_config` → its scheme, or None when there is none. Raises
    UnsupportedModelError, naming `quantization_config.<field>` and the format, for one this engine cannot run."""
    qc = cfg.get(FIELD)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"{FIELD} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fine_grained_fp8(qc)
    fmt = qc.get("format") or qc.get("quant_type") or qc.get("bits")
    raise UnsupportedModelError(
        f"{FIELD}.quant_method {method!r}" + (f" (format {fmt!r})" if fmt is not None else "") + " is not "
        "supported: FP8 checkpoints load (compressed-tensors float-quantized; transformers' fp8 with "
        "weight_block_size [128, 128]); other quantized weights would load without their scales")


def _refuse(field: str, value: Any, want: str, fmt: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{FIELD}.{field} {value!r} is not supported ({fmt}): {want}")


def _compressed_tensors(qc: dict[str, Any]) -> WeightQuant:
    fmt = qc.get("format")
    where = f"compressed-tensors, format {fmt!r}"
    if fmt != "float-quantized":
        raise _refuse("format", fmt, "only float-quantized (FP8 e4m3) checkpoints load", where)
    kv_scales = _ct_kv_cache(qc.get("kv_cache_scheme"), where)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("config_groups", groups, "one or more quantization groups are needed", where)
    schemes = set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(f"config_groups.{name}", group, "a group is an object", where)
        g_fmt = group.get("format")
        if g_fmt is not None and g_fmt != "float-quantized":
            raise _refuse(f"config_groups.{name}.format", g_fmt, "only float-quantized groups load", where)
        if group.get("output_activations") is not None:
            raise _refuse(f"config_groups.{name}.output_activations", group["output_activations"],
                          "outputs are not quantized here", where)
        schemes.add((_ct_weights(group.get("weights"), f"config_groups.{name}.weights", where),
                     _ct_inputs(group.get("input_activations"), f"config_groups.{name}.input_activations", where)))
    if len(schemes) > 1:
        raise _refuse("config_groups", sorted(groups), "every group must share one weight and activation scheme",
                      where)
    (strategy, static), = schemes
    return WeightQuant("compressed-tensors", strategy, "weight_scale", static, kv_scales)


def _ct_kv_cache(args: Any, where: str) -> bool:
    """Whether the checkpoint holds K/V scales: an FP8 KV cache scheme of one static scale a layer for K and
    one for V (`self_attn.k_scale`, `self_attn.v_scale`), as llm-compressor writes it."""
    if args is None:
        return False
    args = _ct_float8(args, "kv_cache_scheme", where)
    if args.get("strategy", "tensor") != "tensor":
        raise _refuse("kv_cache_scheme.strategy", args.get("strategy"), "K/V scales per tensor (one a layer) load",
                      where)
    if args.get("dynamic", False) is not False:
        raise _refuse("kv_cache_scheme.dynamic", args.get("dynamic"), "K/V scales are stored in the checkpoint",
                      where)
    return True


def _ct_float8(args: Any, field: str, where: str) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise _refuse(field, args, "quantization arguments are an object", where)
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise _refuse(f"{field}.num_bits/type", (args.get("num_bits"), args.get("type")),
                      "8-bit float (e4m3) is the one type that loads", where)
    if args.get("symmetric", True) is not True:
        raise _refuse(f"{field}.symmetric", args.get("symmetric"), "FP8 scales are symmetric", where)
    return args


def _ct_weights(args: Any, field: str, where: str) -> str:
    args = _ct_float8(args, field, where)
    strategy = args.get("strategy")
    if strategy not in SCALE_STRATEGIES:
        raise _refuse(f"{field}.strategy", strategy, f"weight scales per {', '.join(SCALE_STRATEGIES)} load", where)
    if args.get("dynamic", False) is not False:
        raise _refuse(f"{field}.dynamic", args.get("dynamic"), "weight scales are stored in the checkpoint", where)
    if strategy == "block" and list(args.get("block_structure") or ()) != [BLOCK, BLOCK]:
        raise _refuse(f"{field}.block_structure", args.get("block_structure"), f"blocks are [{BLOCK}, {BLOCK}]",
                      where)
    return strategy


def _ct_inputs(args: Any, field: str, where: str) -> bool:
    """Whether the activations take static scales from the checkpoint (else dynamic, or none: weights only)."""
    if args is None:
        return False
    args = _ct_float8(args, field, where)
    strategy, dynamic = args.get("strategy"), args.get("dynamic")
    if strategy == "token" or (strategy == "group" and args.get("group_size") == BLOCK):
        if dynamic is not True:
            raise _refuse(f"{field}.dynamic", dynamic, f"per-{strategy} activation scales are dynamic", where)
        return False
    if strategy == "tensor":
        return dynamic is not True
    raise _refuse(f"{field}.strategy", strategy, "activations per token, per tensor or per group of "
                  f"{BLOCK} load", where)


def _fine_grained_fp8(qc: dict[str, Any]) -> WeightQuant:
    block = qc.get("weight_block_size")
    where = f"fp8, weight_block_size {block!r}"
    if block is None or list(block) != [BLOCK, BLOCK]:
        raise _refuse("weight_block_size", block, f"fp8 checkpoints load with [{BLOCK}, {BLOCK}] blocks", where)
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _refuse("activation_scheme", qc.get("activation_scheme"), "activations are quantized dynamically",
                      where)
    if qc.get("scale_fmt", "float") != "float":
        raise _refuse("scale_fmt", qc.get("scale_fmt"), "scales are fp32 (\"float\")", where)
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise _refuse("expert_dtype", qc.get("expert_dtype"), "experts are FP8 like the other weights", where)
    return WeightQuant("fp8-block", "block", "weight_scale_inv", False)
