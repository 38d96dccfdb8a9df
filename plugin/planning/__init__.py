"""Deciding what runs and sizing it: the RAM-budget planner of flash offload (planner and its plan_*
parts, draft_plan), the disk measurement it reads (disk_probe), whether a budget needs offload at all
(budget_decision), the MoE expert plan (expert_plan), and the measured in-memory default (lane_decision)."""
