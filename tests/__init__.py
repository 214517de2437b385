# Generations for the AOT tests of options and alternative paths. Each kernel's defaults and
# benchmark configurations compile on all four generations (kernels.TPU_GENERATIONS); a test of
# one more option or path compiles on the two ends of the range instead: v4 (128x128 MXU, 16 MiB
# of VMEM, so the smallest blocks and its own plans) and v6e (256x256 MXU, 128 MiB, the largest
# blocks). v5e and v5p lie between them on both counts. (CI's 30-minute budget.)
EXTRA_AOT_GENERATIONS = ("v4", "v6e")
