"""Preference training for ``zerotune finetune``: DPO (sigmoid / IPO / hinge, reference-free), ORPO, SimPO,
KTO and reward models -- the data layouts (``pairs``), batches (``batches``), losses (``losses``) and the
objective that runs them through the engine (``objective``)."""
