"""The decoding loops and runs the engine drives (what a step does): `loop` (the interface: a `DecodingLoop`, a
`Run`), `block_loop` (block diffusion), `exact` (exact mode: drafts verified by the causal path) with `speculative`
(its acceptance of sampled tokens), `decision` (decision mode: a form's slots filled at once)."""
