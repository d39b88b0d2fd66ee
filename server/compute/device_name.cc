#include "server/compute/device_name.h"

namespace quantd::compute {

bool ParseDeviceName(const std::string& name, int* cuda_index) {
  if (name == "cpu") {
    *cuda_index = -1;
    return true;
  }
  if (name.rfind("cuda:", 0) != 0 || name.size() < 6 || name.size() > 7) return false;
  int index = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    index = index * 10 + (name[i] - '0');
  }
  *cuda_index = index;
  return true;
}

}  // namespace quantd::compute
