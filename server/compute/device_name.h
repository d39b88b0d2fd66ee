// Device names as specs, `quantd run --device` and `quantd serve --devices` spell them.
#ifndef QUANTD_SERVER_COMPUTE_DEVICE_NAME_H_
#define QUANTD_SERVER_COMPUTE_DEVICE_NAME_H_

#include <string>

namespace quantd::compute {

// "cpu", or "cuda:N" with N of one or two decimal digits. Sets *cuda_index to N (-1 for "cpu");
// false for any other name.
bool ParseDeviceName(const std::string& name, int* cuda_index);

}  // namespace quantd::compute

#endif  // QUANTD_SERVER_COMPUTE_DEVICE_NAME_H_
