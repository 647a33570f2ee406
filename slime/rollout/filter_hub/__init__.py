"""The names a dynamic-sampling filter written for THUDM's slime imports (april.group_filter):
`slime.rollout.filter_hub.base_types.DynamicFilterOutput` and the filter
`slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std`."""
