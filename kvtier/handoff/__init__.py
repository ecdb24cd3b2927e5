"""The KV handoff of prefill/decode disaggregation: a prefill instance sends a prompt's block
records to the decode instance that will generate its answer.

    prefill instance                                decode instance
    reserve(token ids, transport) ----- control --> which blocks it holds; an offer
    engine computes chunk k        (HTTP, or the      (slots, a store, a rank)
    tap: blocks of chunk k ------> `DecodeControl`)
    channel.send(records) ======= transport =====> bytes land (slots / Redis / recv)
    commit(blocks of chunk k) ------------------> validate each record, place the good
                                                  ones in the GPU block pool, held
    ... commit(last=True)                         until the request arrives (or expiry)

Modules, one job each: `base` (the transport seam: `HandoffTransport` and its two channels),
`control` (the decode side's verbs, in process or over HTTP), `receiver` (the decode side:
reservations, validation, placement, holds, expiry), `placement` (blocks into a
`TierManager`'s pool), `sender` (the prefill side of one handoff), and one module per
transport: `cuda_ipc` (copy engines between GPUs of one host), `torch_dist` (NCCL, or gloo
on CPU), `mooncake`, `redis`.
"""
