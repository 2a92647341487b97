"""A hybrid checkpoint's own code (``trust_remote_code=True``) on a GPU, in a process that cannot import
``linearize``: a random 4-layer Llama-shaped model (head size 128, GQA 8:2) made a 3:1 ``lolcats`` hybrid in
bf16 is saved, then loaded from the directory in a child process whose imports of ``linearize`` fail. Prints
the max logit difference over 2 x 700 tokens and whether 16 greedy tokens match the package's class, and which of
our Triton kernels the checkpoint's copies launched (``torch.profiler``). Needs a GPU (CPU: ``DEV=cpu``, the
PyTorch path, as ``tests/test_hybrid_models.py`` does):

    python kernels/bundle_on_device.py [TOKENIZER]     # default: the embedded smollm2-135m tokenizer
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from linearize import recipe as R
from linearize.bench.model import PROFILE_CATEGORIES, load_config, random_model
from linearize.io.checkpoint import save_checkpoint
from linearize.convert.selection import select_layout
from linearize.io.sources import local_dir, resolve
from linearize.convert.surgery import linearize_model

DEV = os.environ.get("DEV", "cuda")
CONFIG = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 49152,
          "max_position_embeddings": 4096, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 1e4}
CHILD = """import re, sys
class NoLinearize:  # the package is not installed, as far as this process can tell
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'linearize':
            raise ImportError(name)
sys.meta_path.insert(0, NoLinearize())
import torch
from torch.profiler import profile
from transformers import AutoModelForCausalLM
ckpt, want, dev, ours = sys.argv[1:5]  # ours: bench model's pattern of our kernel names
m = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, dtype=torch.bfloat16).to(dev)
w = torch.load(want)
with torch.no_grad(), profile() as prof:
    got = m(w['ids'].to(dev)).logits.float().cpu()
    greedy = m.generate(w['ids'][:, :300].to(dev), max_new_tokens=16, do_sample=False).cpu()
ours = sorted({e.key for e in prof.key_averages() if re.search(ours, e.key.lower())})
print(type(m).__module__, '| max abs logit diff', (got - w['want']).abs().max().item(), '| greedy tokens equal',
      torch.equal(greedy, w['greedy']), '| Triton kernels launched:', ', '.join(ours) or 'none',
      '| linearize modules imported:', sorted(k for k in sys.modules if k.split('.')[0] == 'linearize'))
"""

work = Path(tempfile.mkdtemp())
(work / "config.json").write_text(json.dumps(CONFIG))
config, _ = load_config(str(work / "config.json"))
recipe = R.load("lolcats")
hybrid = linearize_model(random_model(config, dtype=torch.bfloat16, device=DEV), select_layout(4, ratio="3:1"), recipe)
tok = AutoTokenizer.from_pretrained(local_dir(resolve(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")))
save_checkpoint(hybrid, tok, work / "ckpt", base="random", recipe=recipe)
ids = torch.randint(0, CONFIG["vocab_size"], (2, 700), generator=torch.Generator().manual_seed(0)).to(DEV)
with torch.no_grad():
    want = {"ids": ids.cpu(), "want": hybrid(ids).logits.float().cpu(),
            "greedy": hybrid.generate(ids[:, :300], max_new_tokens=16, do_sample=False).cpu()}
torch.save(want, work / "want.pt")
ours = dict(PROFILE_CATEGORIES)["linear attention"].pattern
child = subprocess.run([sys.executable, "-c", CHILD, str(work / "ckpt"), str(work / "want.pt"), DEV, ours],
                       capture_output=True, text=True)
print(child.stdout.strip() or child.stderr[-3000:])
sys.exit(child.returncode)
