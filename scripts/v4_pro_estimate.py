#!/usr/bin/env python3
"""Paper estimate of layer-wise calibration of DeepSeek-V4 Pro on 8 GPUs (issue 12's closing note).

Per kind of decoder layer: the weight bytes as stored (FP8 attention and shared expert, MXFP4
routed experts, BF16/F32 small tensors), the activation bytes at a layer boundary (the hc_mult
residual streams [tokens, hc_mult, hidden] in F32, as quantd keeps them: server/model/v4_activations.h;
the official forward rounds them to BF16, half that), the FLOPs per token (attention projections,
sparse attention core, router, mHC mixing, top-k routed experts, shared expert), and the estimated
time to calibrate 128 and 512 samples x 4096 tokens with the samples split over the GPUs (data
parallel slices, each GPU copies each layer's weights once).

Dimensions: ../shared/reference/deepseek_v4_format.md (config table and tensor shapes, Pro column)
and v4_forward_crosscheck.md (section 2, the linears of a decoder layer). Plain python3, no deps.

  scripts/v4_pro_estimate.py [--gpus 8] [--gpu-tflops 1000] [--h2d-gbps 50] [--disk-gbps 10]
                             [--cpu-tokens-per-s R --fixture-config tiny-v4/config.json]
"""

import argparse
import json

# DeepSeek-V4 Pro's config.json (deepseek_v4_format.md, "Root config.json" table).
PRO = {
    "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 129280,
    "num_attention_heads": 128, "head_dim": 512, "q_lora_rank": 1536,
    "o_groups": 16, "o_lora_rank": 1024,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 1024, "sliding_window": 128,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 3072, "num_hash_layers": 3, "hc_mult": 4,
}
SAMPLES = (128, 512, 1024)
SEQ_LEN = 4096
EVAL_SAMPLES = 32  # evaluate.num_samples' default (job/job_spec.h kDefaultEvaluateSamples)

# The machines of the stage table: HBM per GPU, the dense BF16 GEMM rate a layer-wise forward
# achieves (about 45% of peak: B200 ~2250, H100 SXM ~989 TFLOP/s dense), host<->device GB/s.
GPUS = {"8xB200": {"gpus": 8, "hbm_gb": 180, "tflops": 1000, "h2d_gbps": 50},
        "8xH100": {"gpus": 8, "hbm_gb": 80, "tflops": 450, "h2d_gbps": 50}}

# Measured on this project's 2-core CPU machine with scripts/real_scale.sh (pro --layers 1: one
# hash-routed HCA layer, 384 experts; 16 x 512 calibration tokens in 2 slices that ran at once,
# about one core each; 2026-12-07, the closing note of issue 21). Per calibrate slice: its tokens,
# its RunLayer batches (one 512-token sequence each: at 7168 wide one fills the 1 GiB batch
# budget), the seconds decoding routed experts (every batch decodes each expert a token reaches)
# and of the rest of the forward; the quantize stage's and quantd verify's GB/s.
MEASURED_RUN = {
    "tokens": 8 * 512,
    "batches": 8,
    "decode_s": 534.2,
    "forward_s": 567.0,
    "quantize_gbps": 0.180,
    "verify_gbps": 1.854,
}


def fp8(out, inp):
    """FP8 E4M3 weight + one E8M0 byte per 128x128 block."""
    return out * inp + -(-out // 128) * -(-inp // 128)


def mxfp4(out, inp):
    """MXFP4: two E2M1 values per byte + one E8M0 byte per 32 inputs."""
    return out * inp // 2 + out * inp // 32


def layer_bytes(c, ratio, hashed):
    d, h, hd, q = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    g, ol, i, e = c["o_groups"], c["o_lora_rank"], c["moe_intermediate_size"], c["n_routed_experts"]
    hc = c["hc_mult"]
    b = fp8(q, d) + fp8(h * hd, q) + fp8(hd, d) + fp8(g * ol, h * hd // g) + fp8(d, g * ol)
    b += 2 * (2 * d + q + hd) + 4 * h                      # norms (BF16), attn_sink (F32)
    b += 2 * 4 * ((2 + hc) * hc * hc * d + (2 + hc) * hc + 3)  # hc_attn_*, hc_ffn_* (F32)
    if ratio:
        width = (2 if ratio == 4 else 1) * hd               # overlapping windows at ratio 4
        b += 2 * 2 * width * d + 4 * ratio * width + 2 * hd
    if ratio == 4:
        ih, ihd = c["index_n_heads"], c["index_head_dim"]
        b += fp8(ih * ihd, q) + 2 * ih * d + 2 * 2 * 2 * ihd * d + 4 * 4 * 2 * ihd + 2 * ihd
    b += 2 * e * d + (8 * c["vocab_size"] * c["num_experts_per_tok"] if hashed else 4 * e)
    b += e * (2 * mxfp4(i, d) + mxfp4(d, i))
    s = c["n_shared_experts"] * i
    return b + 2 * fp8(s, d) + fp8(d, s)


def visible(c, ratio, seq_len):
    """Mean over positions of (KV entries attended, indexer entries scored) per query token."""
    win, topk = c["sliding_window"], c["index_topk"]
    attended = scored = 0
    for t in range(seq_len):
        compressed = (t + 1) // ratio if ratio else 0
        attended += min(t + 1, win) + (min(topk, compressed) if ratio == 4 else compressed)
        scored += compressed if ratio == 4 else 0
    return attended / seq_len, scored / seq_len


def layer_flops(c, ratio, seq_len):
    """FLOPs per token of one decoder layer (2 per multiply-add)."""
    d, h, hd, q = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    g, ol, i, hc = c["o_groups"], c["o_lora_rank"], c["moe_intermediate_size"], c["hc_mult"]
    macs = q * d + h * hd * q + hd * d + g * ol * (h * hd // g) + d * g * ol
    attended, scored = visible(c, ratio, seq_len)
    macs += 2 * h * hd * attended                             # q.k and p.v
    if ratio:
        macs += 2 * (2 if ratio == 4 else 1) * hd * d          # compressor wkv + wgate
    if ratio == 4:
        ih, ihd = c["index_n_heads"], c["index_head_dim"]
        macs += ih * ihd * q + ih * d + 2 * 2 * ihd * d + ih * ihd * scored
    macs += c["n_routed_experts"] * d + 2 * (2 + hc) * hc * hc * d  # router, hc_pre x2
    macs += (c["num_experts_per_tok"] + c["n_shared_experts"]) * 3 * i * d
    return 2 * macs


def layer_kinds(c):
    """{(compress ratio, hash-routed): [its decoder layers]}, in order of first layer."""
    kinds = {}
    for layer, ratio in enumerate(c["compress_ratios"][: c["num_hidden_layers"]]):
        kinds.setdefault((ratio, layer < c["num_hash_layers"]), []).append(layer)
    return kinds


def layer_list(layers):
    """"0-1", "2", "3,5..59": a run, one layer, or every other layer."""
    if len(layers) == 1:
        return str(layers[0])
    if layers[-1] - layers[0] == len(layers) - 1:
        return f"{layers[0]}-{layers[-1]}"
    return f"{layers[0]},{layers[1]}..{layers[-1]}"


def dense_decoded_bytes(c, ratio):
    """A layer's dense linears decoded to BF16 (model/v4_memory.h): attention, compressor,
    indexer, router, shared expert; small parameters as float32."""
    d, h, hd, q = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    g, ol, i = c["o_groups"], c["o_lora_rank"], c["moe_intermediate_size"]
    values = q * d + h * hd * q + hd * d + g * ol * (h * hd // g) + d * g * ol
    if ratio:
        values += 2 * (2 if ratio == 4 else 1) * hd * d
    if ratio == 4:
        ih, ihd = c["index_n_heads"], c["index_head_dim"]
        values += ih * ihd * q + ih * d + 2 * 2 * ihd * d
    values += c["n_routed_experts"] * d + 3 * c["n_shared_experts"] * i * d
    hc = c["hc_mult"]
    return 2 * values + 4 * 2 * (2 + hc) * hc * hc * d


def batch_bytes(c, sequences, seq_len):
    """One RunLayer call's working memory (calibration/calibrate_layer.cc EstimateBatchBytes)."""
    per_token = (4 * c["hc_mult"] * c["hidden_size"] + 4 * c["hidden_size"] + c["q_lora_rank"]
                 + 3 * c["num_attention_heads"] * c["head_dim"] + c["n_routed_experts"]
                 + 3 * (c["num_experts_per_tok"] + c["n_shared_experts"])
                 * c["moe_intermediate_size"])
    keys = min(seq_len, c["sliding_window"] + c["index_topk"] + seq_len // 4)
    return 4 * (sequences * seq_len * per_token + sequences * c["num_attention_heads"] * seq_len
                * keys)


def stage_table(c, G, disk_gbps):
    """Memory per GPU and seconds per stage on each machine of GPUS."""
    i, d, e = c["moe_intermediate_size"], c["hidden_size"], c["n_routed_experts"]
    act_per_token = c["hc_mult"] * d * 4 + 4
    kinds = layer_kinds(c)
    dense = max(dense_decoded_bytes(c, r) for r, _ in kinds)
    stored_experts = e * (2 * mxfp4(i, d) + mxfp4(d, i))
    one_expert = 2 * 3 * i * d
    work = batch_bytes(c, 1, SEQ_LEN)
    layers = c["num_hidden_layers"]
    total_bytes = sum(len(ls) * layer_bytes(c, r, h) for (r, h), ls in kinds.items())
    whole = total_bytes + 2 * 2 * c["vocab_size"] * d
    flops = {n: sum(len(ls) * layer_flops(c, r, SEQ_LEN) for (r, _), ls in kinds.items())
             for n in SAMPLES}
    print()
    print("per GPU memory of a calibrate layer task (host model of model/v4_memory.h: dense "
          "weights decoded, experts kept as stored, one decoded at a time)")
    print(f"  dense weights {dense / G:.2f} GB + routed experts as stored {stored_experts / G:.2f}"
          f" GB + one expert decoded {one_expert / G:.3f} GB + one {SEQ_LEN}-token sequence's "
          f"working memory {work / G:.2f} GB")
    seq_act = 2 * SEQ_LEN * act_per_token  # one sequence's streams in and out
    gpu = dense + stored_experts + one_expert + work + seq_act
    for name, m in GPUS.items():
        print(f"  {name}: {gpu / G:.1f} GB per GPU with one sequence a batch "
              f"({'fits' if gpu <= m['hbm_gb'] * G else 'DOES NOT FIT'} in {m['hbm_gb']} GB); the "
              "slice's activations between layers stay in host memory (ActivationStore, spilled "
              "past its budget): " + ", ".join(
                  f"{n} samples {2 * n * SEQ_LEN * act_per_token / m['gpus'] / G:.1f} GB"
                  for n in SAMPLES) + f" per GPU (the node holds {m['gpus']} times that, on "
              "disk where it exceeds the host budget)")
    print(f"  today's CUDA upload decodes every expert of the layer: {e * one_expert / G:.1f} GB "
          "instead of the stored experts and one decoded")
    print()
    print(f"seconds per stage (quantize and verify bound by {disk_gbps:g} GB/s of disk over the "
          f"{whole / G:.0f} GB, which assumes the GPUs' codecs keep up: never measured, no GPU has "
          f"run quantd; evaluate: {EVAL_SAMPLES} held-out samples, 3 forwards per layer on one "
          "GPU, then the head)")
    head = f"{'machine':>8} {'samples':>7} {'quantize':>9} {'calibrate':>10} {'evaluate':>9} " \
           f"{'verify':>7}"
    print(head)
    for name, m in GPUS.items():
        for n in SAMPLES:
            tokens = n * SEQ_LEN
            load = total_bytes / (disk_gbps * G) + total_bytes / (m["h2d_gbps"] * G)
            calibrate = (load + tokens / m["gpus"] * flops[n] / (m["tflops"] * 1e12)
                         + layers * 2 * tokens * act_per_token / m["gpus"] / (m["h2d_gbps"] * G))
            held_out = EVAL_SAMPLES * SEQ_LEN
            head_flops = 2 * 2 * held_out * c["vocab_size"] * d
            evaluate = (2 * load + (3 * held_out * flops[n] + head_flops) / (m["tflops"] * 1e12))
            io = whole / (disk_gbps * G)
            print(f"{name:>8} {n:>7} {io:9.0f} {calibrate:10.0f} {evaluate:9.0f} {io:7.0f}")


def measured(c, G):
    """The real-shape run on this machine against the model."""
    r = MEASURED_RUN
    flops = layer_flops(c, 128, 512) * r["tokens"]
    i, d, e = c["moe_intermediate_size"], c["hidden_size"], c["n_routed_experts"]
    decoded = r["batches"] * e * (2 * mxfp4(i, d) + mxfp4(d, i))  # every expert, every batch
    print()
    print(f"measured (scripts/real_scale.sh, pro --layers 1, a slice of {r['tokens']} tokens on "
          f"about one core): forward {r['forward_s']:.0f} s = "
          f"{flops / r['forward_s'] / G:.1f} GFLOP/s for the model's {flops / 1e12:.1f} TFLOP; "
          f"routed experts decoded {r['batches']} times (once per batch) in {r['decode_s']:.0f} s "
          f"= {decoded / r['decode_s'] / G:.2f} GB/s of MXFP4; quantize "
          f"{r['quantize_gbps']:.3f} GB/s, verify {r['verify_gbps']:.2f} GB/s (source in the page "
          "cache)")
    print("  the model above assumes the experts' decode hides under the GEMMs and one load per "
          f"layer; measured, decoding costs {r['decode_s'] / r['forward_s']:.2f}x the forward, "
          "because it repeats per batch: batches that take many sequences (or a MoE that takes "
          "every batch's rows per expert) are what makes the model's load term true")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=8, help="data parallel slices (default 8 B200)")
    p.add_argument("--gpu-tflops", type=float, default=1000,
                   help="achieved dense BF16 GEMM TFLOP/s per GPU (B200 peak ~2250; default 1000)")
    p.add_argument("--h2d-gbps", type=float, default=50,
                   help="host<->device GB/s per GPU (PCIe 5 x16 ~64 peak; default 50)")
    p.add_argument("--disk-gbps", type=float, default=10,
                   help="source read GB/s (each layer read once into host memory; default 10)")
    p.add_argument("--cpu-tokens-per-s", type=float,
                   help="measured CPU calibration tokens/s per layer on a fixture")
    p.add_argument("--fixture-config", help="the fixture's config.json (with --cpu-tokens-per-s)")
    args = p.parse_args()
    c = PRO
    G = 1e9
    print(f"DeepSeek-V4 Pro: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
          f"hc_mult {c['hc_mult']}, {c['n_routed_experts']} experts (top {c['num_experts_per_tok']}"
          f", intermediate {c['moe_intermediate_size']}), seq_len {SEQ_LEN}, {args.gpus} GPUs")
    act_per_token = c["hc_mult"] * c["hidden_size"] * 4 + 4  # F32 streams + the token id
    head = (f"{'layers':>8} {'kind':>9} {'weights GB':>10} {'GFLOP/tok':>9}"
            + "".join(f" {f'act GB x{n}':>10} {f's/layer x{n}':>11}" for n in SAMPLES))
    print(head)
    print("-" * len(head))
    total_bytes, total_s = 0, {n: 0.0 for n in SAMPLES}
    for (ratio, hashed), layers in layer_kinds(c).items():
        count = len(layers)
        wb = layer_bytes(c, ratio, hashed)
        fl = layer_flops(c, ratio, SEQ_LEN)
        total_bytes += count * wb
        kind = {0: "window", 4: "CSA", 128: "HCA"}[ratio] + ("+hash" if hashed else "")
        row = f"{layer_list(layers):>8} {kind:>9} {wb / G:10.2f} {fl / G:9.2f}"
        for n in SAMPLES:
            tokens = n * SEQ_LEN
            act = tokens * act_per_token
            load = wb / (args.disk_gbps * G) + wb / (args.h2d_gbps * G)
            compute = tokens / args.gpus * fl / (args.gpu_tflops * 1e12)
            move = 2 * act / args.gpus / (args.h2d_gbps * G)  # previous output in, this output out
            seconds = load + compute + move
            total_s[n] += count * seconds
            row += f" {act / G:10.1f} {seconds:11.1f}"
        print(row)
    print("-" * len(head))
    print(f"decoder layers {total_bytes / G:.1f} GB; calibration " +
          ", ".join(f"{n} samples: {total_s[n] / 60:.1f} min" for n in SAMPLES))
    # Check against the real checkpoint: + embed and head (BF16) + the MTP layer (a ratio-0
    # layer, e_proj and h_proj FP8 [d, d]); the Pro dump's "805.33 GB" total matches in GiB.
    d = c["hidden_size"]
    whole = total_bytes + 2 * 2 * c["vocab_size"] * d + layer_bytes(c, 0, False) + 2 * fp8(d, d)
    print(f"whole checkpoint {whole / 2**30:.1f} GiB (deepseek_v4_format.md: 805.33, 64 shards)")
    print("assumptions: per layer, load (disk once + one host-to-device copy per GPU) + forward "
          f"({args.gpu_tflops:g} TFLOP/s per GPU on its 1/{args.gpus} of the tokens) + activations "
          f"in and out over {args.h2d_gbps:g} GB/s, not overlapped (an upper bound); activations "
          "F32 (BF16 halves them); no MTP layer; calibrate_all_experts would multiply the routed "
          f"expert FLOPs by {c['n_routed_experts'] // c['num_experts_per_tok']}.")
    stage_table(c, G, args.disk_gbps)
    measured(c, G)
    if args.cpu_tokens_per_s:
        if not args.fixture_config:
            p.error("--cpu-tokens-per-s needs --fixture-config (the fixture it was measured on)")
        with open(args.fixture_config) as f:
            fixture = json.load(f)
        ratios = fixture["compress_ratios"][: fixture["num_hidden_layers"]]
        fixture_flops = sum(layer_flops(fixture, r, min(SEQ_LEN, 256)) for r in ratios) / len(ratios)
        rate = args.cpu_tokens_per_s * fixture_flops
        pro = sum(layer_flops(c, r, SEQ_LEN) for r in c["compress_ratios"][: c["num_hidden_layers"]])
        print(f"CPU path: {args.cpu_tokens_per_s:g} tokens/s per layer on the fixture "
              f"({fixture_flops / 1e6:.1f} MFLOP/token/layer at seq_len 256) = "
              f"{rate / G:.1f} GFLOP/s; Pro, {SAMPLES[0]} samples: "
              f"{SAMPLES[0] * SEQ_LEN * pro / rate / 86400:.0f} days at that rate")


if __name__ == "__main__":
    main()
