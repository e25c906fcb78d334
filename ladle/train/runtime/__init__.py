"""Worker-side helpers of the strategies. Those that import torch at module level are imported only inside
training processes; ``zero`` imports torch and DeepSpeed only inside its functions, so ``ladle.strategies.deepspeed``
imports it while planning stays free of torch."""
