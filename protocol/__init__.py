"""The mathematics of lowcomm-node: outer optimizers and codecs (see docs/protocols.md).

Pure torch + stdlib (and msgpack for the exact size of a codec description). Nothing here opens
a socket, starts a loop or imports `node` or `p2p`. Every algorithm works on dicts of named fp32
tensors (name -> torch.Tensor, a model's parameters). Modules include:

- protocol.noloco      NoLoCo outer step with a group of any size (§1)
- protocol.diloco      DiLoCo outer Nesterov step, torch SGD's update rounded alike on any hardware (§2)
- protocol.dilocox     DiLoCoX: compressed pseudo-gradients, error feedback, one-step delay (§3)
- protocol.codecs      tensor codecs behind one interface, with a registry `get_codec`
- protocol.controller  the per-round adaptation of rank, bits and H (§3 "Adaptation")
- protocol.tensors     the small operations the algorithms share
- protocol.errors      the error types; all derive from ValueError
"""
