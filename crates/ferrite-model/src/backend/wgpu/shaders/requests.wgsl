// Which request a token of the step belongs to (prepended to the kernels that bind the step's
// words as `st`).

// The last request i with cu[i] <= t, of `seqs`, cu_seqlens at word `cu` of `st`.
fn request_of(cu: u32, seqs: u32, t: u32) -> u32 {
    var lo = 0u;
    var hi = seqs;
    while hi - lo > 1u {
        let mid = (lo + hi) / 2u;
        if st[cu + mid] <= t {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

