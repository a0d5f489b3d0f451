"""The engine's contract, declared once: what the hardware computes and how the host talks to it.

Every layer reads these modules and none of them reads anything else of the project (numpy
only, no Amaranth, no torch), so a hardware engineer, the functional model and the compiler
agree by construction:

* :mod:`~dfvg_hw.spec.config` — :class:`EngineConfig`, its presets and validation;
* :mod:`~dfvg_hw.spec.isa` — the instruction word, opcodes, flags, encoder, decoder, assembler;
* :mod:`~dfvg_hw.spec.numerics` — the fixed-point arithmetic of every unit;
* :mod:`~dfvg_hw.spec.regmap` — the register map and the device-memory map;
* :mod:`~dfvg_hw.spec.descriptors` — request and result descriptors, error codes;
* :mod:`~dfvg_hw.spec.image` — the weights-image layout.
"""
