// Sums and maxima across a workgroup of WG threads through workgroup memory (prepended to
// the kernels that define WG).

var<workgroup> part: array<f32, WG>;

fn total(v: f32, i: u32) -> f32 {
    part[i] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if i < s {
            part[i] += part[i + s];
        }
        workgroupBarrier();
    }
    let t = part[0];
    workgroupBarrier();
    return t;
}

fn largest(v: f32, i: u32) -> f32 {
    part[i] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if i < s {
            part[i] = max(part[i], part[i + s]);
        }
        workgroupBarrier();
    }
    let t = part[0];
    workgroupBarrier();
    return t;
}
