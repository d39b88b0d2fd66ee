#include "server/model/v4_numerics.h"

namespace quantd::model {

const char* NumericsName(Numerics numerics) {
  return numerics == Numerics::kMath ? "math" : "official";
}

}  // namespace quantd::model
