// The tensor-core kernels' shape, shared by the forward (attention/coop/forward.wgsl) and the
// backward (attention/coop/backward_tiles.wgsl): NSG tile groups of SG invocations (subgroups in
// the tensor-core build), and the head dims with their widths rounded up to whole 16-wide tiles
// (the padding is staged as zeros). The host sets SG, NSG, DK and DV for every pipeline.

override SG: u32 = 32u;
override NSG: u32 = 4u;
override WG: u32 = SG * NSG;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DKP: u32 = (DK + 15u) / 16u * 16u;
override DVP: u32 = (DV + 15u) / 16u * 16u;
