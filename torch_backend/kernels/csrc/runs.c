/* Copies between a flat buffer's runs and one packed vector (torch_backend/kernels/runs.py):
 * a DDP bucket's flat group whose tensors are not contiguous in the bucket (tensors of other
 * routes between them) is gathered into one vector and written back, run by run, with memcpy.
 *
 * Plain C99. runs: nruns pairs (start, stop) of element positions in the buffer, in the packed
 * vector's order; itemsize: bytes per element. gather != 0: packed <- buffer's runs, else the
 * buffer's runs <- packed. */
#include <stdint.h>
#include <string.h>

void hgc_copy_runs(char *buffer, char *packed, const int64_t *runs, int64_t nruns, int64_t itemsize,
                   int64_t gather)
{
    int64_t at = 0;
    for (int64_t r = 0; r < nruns; r++) {
        int64_t start = runs[2 * r], n = runs[2 * r + 1] - start;
        if (gather)
            memcpy(packed + at * itemsize, buffer + start * itemsize, (size_t)(n * itemsize));
        else
            memcpy(buffer + start * itemsize, packed + at * itemsize, (size_t)(n * itemsize));
        at += n;
    }
}
