"""Read a `/load_lora_adapter_from_tensors` request body as SGLang 0.5.23 does (run with the SGLang venv's Python,
CPU shims on PYTHONPATH): the endpoint's request type, each TP rank's tensor payload, the adapter's config and
`LoRAAdapter`'s weight normalisation. Writes what SGLang holds to a torch file.

    python read_lora_request.py REQUEST.json MODEL_DIR OUT.pt
"""

from __future__ import annotations

import json
import sys

import msgspec
import torch
from pydantic import TypeAdapter
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.utils import get_normalized_target_modules
from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
from transformers import AutoConfig

raw = open(sys.argv[1]).read()
fields = {f.name for f in msgspec.structs.fields(LoadLoRAAdapterFromTensorsReqInput)}
unknown = set(json.loads(raw)) - fields  # the endpoint ignores unknown keys: a misspelt one would vanish
assert not unknown, f"keys SGLang's request type does not have: {unknown}"
request = TypeAdapter(LoadLoRAAdapterFromTensorsReqInput).validate_json(raw)  # as FastAPI decodes the body
payloads = normalize_serialized_named_tensor_payloads(request.serialized_named_tensors)
ranks = [MultiprocessingSerializer.deserialize(p) for p in payloads]
assert all(r.keys() == ranks[0].keys() for r in ranks)
config = LoRAConfig.from_dict(request.config_dict)
adapter = LoRAAdapter("check", config, AutoConfig.from_pretrained(sys.argv[2]), None, None)
adapter.initialize_weights_from_tensors(ranks[-1])
torch.save(
    {
        "targets": sorted(get_normalized_target_modules(config.target_modules)),
        "scaling": adapter.scaling,
        "layers": [dict(layer.weights) for layer in adapter.layers],
    },
    sys.argv[3],
)
