# A slime custom reward as slime users write it (--custom-rm-path repro/slime_rm.py:rm)
Sample = object  # slime.utils.types.Sample does not exist here


async def rm(args, sample: Sample, **kwargs):
    return float(sample.response.strip() == str(sample.label))
