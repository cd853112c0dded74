"""How the work is split across processes, imported as `k3train.parallel`.

Will hold: `state.py` (process groups for DP/TP/PP/EP from the launcher's environment),
`tensor.py` (column/row-parallel linears, sequence parallel, vocab-parallel embedding and loss),
`pipeline.py` (1F1B and interleaved schedules with the AttnRes block cache), `expert.py`
(fixed-size latent all-to-all dispatch), `data.py` (bucketed gradient reduction, ZeRO-1,
distributed Per-Head Muon) and `comm.py` (collectives that count their traffic).
"""
