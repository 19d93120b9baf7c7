"""The MoE seam: every MoE and dense MLP of a model, on one rank or many.

    layer.SparseMoE         router -> top-k -> MoEExecutor.run -> + shared experts
    router.Router           hidden states -> fp32 logits per logical expert
    expert_weights          ExpertWeights: w13 [E_local, 2I, H], w2 [E_local, H, I]; a load_balancer.ExpertStore
    dense_mlp.DenseMLP      ExpertWeights with one local expert (dense layers, shared experts), TP-sharded
    executor.MoEExecutor    explicit layer registration, placement -> replica choice -> ModularMoE -> TP gather
    modular_moe.ModularMoE  one dispatcher (moe_runtime/dispatch/: local, all_to_all, allgather, deepep) x one ExpertKernel
    expert_kernel           ExpertKernel Protocol: contiguous or masked layout, from the KernelSet (torch, Triton)
    token_share.TokenShare  the attention-TP share of the tokens each rank dispatches
    stages                  staged forward passes (yield while dispatch/combine are in flight), two-batch interleaving
    comm_timeline           per-phase timestamps of each dispatch/combine: how much of it compute hid
"""
